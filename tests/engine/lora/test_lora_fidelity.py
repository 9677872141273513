"""Mixed adapters in one batch give what PEFT's own forward gives (#58 items 4, 7): rows of two
adapters and the base prefill together and decode in the same steps; their sampled tokens'
logprobs, top logprobs, prompt logprobs and teacher-forced scores equal ``PeftModel``'s forward of
each adapter alone, and the base rows equal the base model's."""

from __future__ import annotations

import pytest

from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.lora.errors import AdapterLimitError, AdapterNotFoundError
from engine.sampling_params import SamplingParams
from engine.scoring import ScoreRequest
from tests.engine.lora.lora_support import peft_reference
from tests.fidelity import assert_close, assert_top_logprobs

TOP = 3


@pytest.fixture(scope="module")
def lora_engine(demo_model_dir, adapter_a, adapter_b):
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    engine.load_adapter("a@1", adapter_a)
    engine.load_adapter("b@1", adapter_b)
    return engine


@pytest.fixture(scope="module")
def references(demo_model_dir, adapter_a, adapter_b):
    return {"": peft_reference(demo_model_dir, None), "a@1": peft_reference(demo_model_dir, adapter_a),
            "b@1": peft_reference(demo_model_dir, adapter_b)}


def _check_choice(result, reference, prompt, what, *, top=True):
    [choice] = result.choices
    assert_close(choice.logprobs, reference.token_logprobs(prompt, choice.token_ids), f"{what} token logprobs")
    if top:
        assert_top_logprobs(choice.top_logprobs, reference, prompt, choice.token_ids, (), TOP, f"{what} top")


def test_mixed_rows_generate_what_peft_computes(lora_engine, references, prompts):
    short, long = prompts.text("Hello there, adapters"), prompts.text("A longer prompt that runs over a block or two "
                                                                     "so rows of each length share the batch.")
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=TOP, prompt_logprobs=TOP)
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=5, ignore_eos=True, top_logprobs=TOP)
    # The same prompt under the base and both adapters in one call: nothing may be shared between them.
    cases = [("", short, greedy), ("a@1", short, greedy), ("b@1", short, greedy), ("a@1", long, seeded),
             ("", long, seeded), ("b@1", long, greedy)]
    results = lora_engine.generate([GenerationRequest(p, s, adapter=a) for a, p, s in cases])
    firsts = set()
    for (adapter, prompt, params), result in zip(cases, results, strict=True):
        reference = references[adapter]
        _check_choice(result, reference, prompt, f"adapter {adapter or 'base'}")
        if params.prompt_logprobs:
            assert_close(result.prompt_logprobs[1:], reference.prompt_logprobs(prompt), f"{adapter} prompt logprobs")
        if prompt is short:
            firsts.add(round(result.choices[0].logprobs[0], 4))
        span = {"version": lora_engine.weight_version, "start": 0, "end": params.max_tokens}
        assert result.choices[0].weight_versions == [{**span, "adapter": adapter} if adapter else span]
    assert len(firsts) == 3, "each adapter moves the distribution: the three rows must differ"


def test_rows_join_a_running_batch_under_other_adapters(lora_engine, references, prompts):
    """A base row decodes while rows of each adapter join it steps later (prefilled into a busy batch)."""
    prompt = prompts.text("Rows join the batch while others decode")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    scheduler = lora_engine.scheduler()
    results = {}
    try:
        scheduler.submit(GenerationRequest(prompt, params), tag="")
        for step in range(12):
            if step == 2:
                scheduler.submit(GenerationRequest(prompt, params, adapter="a@1"), tag="a@1")
            if step == 4:
                scheduler.submit(GenerationRequest(prompt, params, adapter="b@1"), tag="b@1")
            for finished in scheduler.step():
                assert finished.error is None
                results[finished.tag] = finished.result
            if not scheduler.has_work:
                break
    finally:
        scheduler.close()
    assert sorted(results) == ["", "a@1", "b@1"]
    for adapter, result in results.items():
        _check_choice(result, references[adapter], prompt, f"joined {adapter or 'base'}", top=False)


def test_a_cached_prefix_is_reused_only_under_its_adapter(lora_engine, references, prompts):
    prompt = prompts.text("The same prefix under the base and then an adapter, long enough for full blocks " * 2)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    [base] = lora_engine.generate([GenerationRequest(prompt, params)])
    [first] = lora_engine.generate([GenerationRequest(prompt, params, adapter="a@1")])
    [again] = lora_engine.generate([GenerationRequest(prompt, params, adapter="a@1")])
    assert first.cached_tokens == 0, "the base's KV must not serve an adapter's prompt"
    assert again.cached_tokens > 0, "the adapter's own KV serves its next prompt"
    for result, adapter in ((base, ""), (first, "a@1"), (again, "a@1")):
        _check_choice(result, references[adapter], prompt, f"cached {adapter or 'base'}", top=False)


def test_score_rows_of_each_adapter_in_one_forward(lora_engine, references, prompts):
    prompt, completion = prompts.text("Score this under"), prompts.text(" three sets of weights at once")
    requests = [ScoreRequest(prompt, completion, adapter=a) for a in ("b@1", "", "a@1")]
    for request, result in zip(requests, lora_engine.score(requests), strict=True):
        want = references[request.adapter].token_logprobs(prompt, completion)
        assert_close(result.logprobs, want, f"score {request.adapter or 'base'}")


def test_an_unknown_adapter_is_refused_not_served_by_the_base(lora_engine, prompts):
    prompt = prompts.text("who serves this")
    with pytest.raises(AdapterNotFoundError) as raised:
        lora_engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=1), adapter="c@1")])
    assert raised.value.code == "adapter_not_found"
    with pytest.raises(AdapterNotFoundError):
        lora_engine.score([ScoreRequest(prompt, prompt, adapter="c@1")])


def test_adapters_beyond_the_slots_wait_on_the_cpu_and_swap_in(demo_model_dir, adapter_a, adapter_b, references,
                                                                 prompts):
    """One device slot, two adapters (#58 item 6): the second adapter's rows wait until the first's
    end (the base's run beside either), then it is brought in from the CPU; every row is PEFT's own."""
    engine = Engine(load_model(str(demo_model_dir), device="cpu"), max_loras=1, max_cpu_loras=2)
    engine.load_adapter("a@1", adapter_a)
    engine.load_adapter("b@1", adapter_b)
    assert engine.loaded.adapters.resident() == ["a@1"]
    prompt = prompts.text("one slot for two adapters")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    cases = ["b@1", "", "a@1", "b@1", "a@1"]
    results = engine.generate([GenerationRequest(prompt, params, adapter=a) for a in cases])
    for adapter, result in zip(cases, results, strict=True):
        _check_choice(result, references[adapter], prompt, f"swapped {adapter or 'base'}", top=False)
    assert engine.loaded.adapters.swaps_in >= 2, "the second adapter came in from the CPU"
    with pytest.raises(AdapterLimitError):
        engine.load_adapter("c@1", adapter_a)  # ROLLOUT_MAX_CPU_LORAS


def test_the_encoder_cache_is_shared_across_adapters(lora_engine, references, prompts):
    """An image encoded for a base row serves an adapter's row (adapters never touch the encoder),
    and the adapter's tokens are still PEFT's own."""
    features = prompts.image_features(color="blue")
    prompt = prompts.image_prompt(" what colour is it?", features)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    lora_engine.generate([GenerationRequest(prompt, params, mm_kwargs=features)])
    hits = lora_engine.encoder_cache.stats.hits
    [tuned] = lora_engine.generate([GenerationRequest(prompt, params, mm_kwargs=features, adapter="a@1")])
    assert lora_engine.encoder_cache.stats.hits == hits + 1
    [choice] = tuned.choices
    want = _image_logprobs(references["a@1"], prompt, choice.token_ids, features, prompts.config.image_token_id)
    assert_close(choice.logprobs, want, "adapter row with a cached image")


def _image_logprobs(reference, prompt, completion, features, image_token_id):
    import torch

    ids = torch.tensor([[*prompt, *completion]])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **features,
              "mm_token_type_ids": (ids == image_token_id).int()}  # as the Qwen-VL processors build them
    with torch.inference_mode():
        logits = reference.model(**kwargs).logits[0].float().log_softmax(-1)
    start = len(prompt) - 1
    return [float(logits[start + i, token]) for i, token in enumerate(completion)]


def test_a_bfloat16_base_computes_the_lora_product_in_float32_as_peft_does(demo_model_dir, adapter_a):
    """PEFT keeps an adapter in float32 on a half-precision base (``autocast_adapter_dtype``) and adds
    its product to the base's output in float32: the engine's rows match it on a bfloat16 model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForMultimodalLM

    engine = Engine(load_model(str(demo_model_dir), device="cpu", dtype="bfloat16"))
    engine.load_adapter("a@1", adapter_a)
    prompt, params = [300, 301, 302, 303, 304, 305], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    results = engine.generate([GenerationRequest(prompt, params, adapter="a@1"), GenerationRequest(prompt, params)])
    base = AutoModelForMultimodalLM.from_pretrained(demo_model_dir, dtype=torch.bfloat16).eval()
    tuned = PeftModel.from_pretrained(AutoModelForMultimodalLM.from_pretrained(demo_model_dir, dtype=torch.bfloat16),
                                      adapter_a).eval()
    for result, model, what in ((results[0], tuned, "adapter"), (results[1], base, "base")):
        [choice] = result.choices
        ids = torch.tensor([[*prompt, *choice.token_ids]])
        with torch.inference_mode():
            dists = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float().log_softmax(-1)
        want = [float(dists[len(prompt) - 1 + i, token]) for i, token in enumerate(choice.token_ids)]
        assert_close(choice.logprobs, want, f"bfloat16 {what}")


def test_a_job_waiting_for_a_slot_is_not_starved_by_a_busy_adapter(demo_model_dir, adapter_a, adapter_b, prompts):
    """One slot held by a's stream of jobs: b's job waits, and from then on a's new jobs wait too
    (a drains), so b runs before the a jobs that came after it; the base never waits."""
    engine = Engine(load_model(str(demo_model_dir), device="cpu"), max_loras=1, max_cpu_loras=2)
    engine.load_adapter("a@1", adapter_a)
    engine.load_adapter("b@1", adapter_b)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = prompts.text("a stream of jobs")
    scheduler = engine.scheduler()
    ended = []
    try:
        scheduler.submit(GenerationRequest(prompt, params, adapter="a@1"), tag="a-first")
        ended += [f.tag for f in scheduler.step()]
        scheduler.submit(GenerationRequest(prompt, params, adapter="b@1"), tag="b")
        for step in range(40):
            if step < 12:  # a keeps sending while b waits
                scheduler.submit(GenerationRequest(prompt, params, adapter="a@1"), tag=f"a-{step}")
            if step == 2:
                scheduler.submit(GenerationRequest(prompt, params), tag="base")
            ended += [f.tag for f in scheduler.step()]
            if not scheduler.has_work:
                break
    finally:
        scheduler.close()
    assert ended.index("b") < ended.index("a-0"), ended
    assert ended.index("base") < ended.index("b"), "the base joins while the slot drains"
