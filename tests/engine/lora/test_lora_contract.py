"""The fidelity contract with adapters (#58 item 7): on every registered architecture and every
modality it takes, a random PEFT adapter's rows, batched with base rows, give the tokens, top
logprobs and prompt logprobs of ``PeftModel``'s own forward, and the base rows the base's; scoring
under the adapter too. The registry is enumerated (tests/fidelity.py), so an architecture added
later is covered without editing this test."""

from __future__ import annotations

import pytest

from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams
from engine.scoring import ScoreRequest
from tests.engine.lora.lora_support import make_adapter, peft_reference
from tests.fidelity import (
    assert_close,
    assert_top_logprobs,
    demo_dir_for,
    demo_dirs,
    make_prompt,
    registry_cases,
)

TOP = 2


@pytest.fixture(scope="module")
def lora_arch_setup(tmp_path_factory):
    """``setup(registered)`` -> (engine with adapter "t@1", processor, base reference, PEFT reference)."""
    from processors.registry import load_processor

    dirs = demo_dirs(tmp_path_factory.mktemp("lora-contract-models"))
    built = {}

    def setup(registered):
        directory = demo_dir_for(dirs, registered)
        if directory not in built:
            adapter = make_adapter(directory, tmp_path_factory.mktemp("lora-contract") / "adapter", rank=4, alpha=8,
                                   seed=7, suffixes=("q_proj", "v_proj", "o_proj", "down_proj"))
            processor = load_processor(directory)
            engine = Engine(load_model(str(directory), device="cpu"))
            engine.load_adapter("t@1", adapter)
            built[directory] = (engine, processor, peft_reference(directory, None, processor.hf),
                                peft_reference(directory, adapter, processor.hf))
        return built[directory]

    return setup


@pytest.mark.parametrize(("registered", "modality"), list(registry_cases()))
def test_adapter_rows_beside_base_rows_are_pefts_own(registered, modality, lora_arch_setup):
    engine, processor, base, tuned = lora_arch_setup(registered)
    prompt = make_prompt(processor, modality)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, top_logprobs=TOP, prompt_logprobs=TOP)
    results = engine.generate([GenerationRequest(prompt.token_ids, params, items=prompt.items, adapter="t@1"),
                               GenerationRequest(prompt.token_ids, params, items=prompt.items)])
    for result, reference, label in zip(results, (tuned, base), ("adapter", "base"), strict=True):
        [choice] = result.choices
        what = f"{registered} {modality} {label}"
        assert_close(choice.logprobs, reference.token_logprobs(prompt.token_ids, choice.token_ids, prompt.items),
                     f"{what} token logprobs")
        assert_top_logprobs(choice.top_logprobs, reference, prompt.token_ids, choice.token_ids, prompt.items, TOP,
                            f"{what} top logprobs")
        assert_close(result.prompt_logprobs[1:], reference.prompt_logprobs(prompt.token_ids, prompt.items),
                     f"{what} prompt logprobs")
    completion = results[0].choices[0].token_ids
    [scored] = engine.score([ScoreRequest(prompt.token_ids, completion, items=prompt.items, adapter="t@1")])
    assert_close(scored.logprobs, tuned.token_logprobs(prompt.token_ids, completion, prompt.items),
                 f"{registered} {modality} adapter score")
