"""The fidelity contract, engine side: on every registered architecture and every modality it takes,
every logprob the engine returns equals transformers' own forward on the same ids and media.

Paths: sampled-token logprobs (greedy, and seeded at temperature 1), top-k logprobs, prompt
logprobs, teacher-forced scoring alone and in one batch with rows of other lengths and media.
The routes that carry these numbers to clients are checked in ``tests/e2e/test_fidelity_routes.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.capacity import SchedulerLimits
from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams
from engine.scoring import ScoreRequest
from tests.fidelity import (
    Reference,
    assert_close,
    assert_top_logprobs,
    demo_dir_for,
    demo_dirs,
    make_prompt,
    poison_free_blocks,
    registry_cases,
)

TOP = 3


@pytest.fixture(scope="session")
def fidelity_dirs(tmp_path_factory):
    return demo_dirs(tmp_path_factory.mktemp("fidelity-models"))


@pytest.fixture(scope="session")
def arch_setup(fidelity_dirs):
    """``setup(registered)`` -> (engine, processor, reference), built once per architecture."""
    from processors.registry import load_processor

    built = {}

    def setup(registered):
        if registered not in built:
            directory = demo_dir_for(fidelity_dirs, registered)
            processor = load_processor(directory)
            built[registered] = (Engine(load_model(str(directory), device="cpu")), processor,
                                 Reference(directory, processor.hf))
        return built[registered]

    return setup


def test_every_registered_architecture_has_a_demo_model(fidelity_dirs):
    from processors.registry import supported_architectures

    missing = set(supported_architectures()) - set(fidelity_dirs)
    assert not missing, f"registered without a demo model (so unchecked): {sorted(missing)}"


@pytest.mark.parametrize(("registered", "modality"), list(registry_cases()))
def test_generation_logprobs_are_the_models_own(registered, modality, arch_setup):
    engine, processor, reference = arch_setup(registered)
    prompt = make_prompt(processor, modality)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, top_logprobs=TOP, prompt_logprobs=TOP)
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=11, ignore_eos=True, top_logprobs=TOP)
    results = engine.generate([GenerationRequest(prompt.token_ids, greedy, items=prompt.items),
                               GenerationRequest(prompt.token_ids, seeded, items=prompt.items)])
    for label, result in zip(("greedy", "seeded"), results, strict=True):
        [choice] = result.choices
        want = reference.token_logprobs(prompt.token_ids, choice.token_ids, prompt.items)
        assert_close(choice.logprobs, want, f"{registered} {modality} {label} token logprobs")
        assert_top_logprobs(choice.top_logprobs, reference, prompt.token_ids, choice.token_ids, prompt.items, TOP,
                            f"{registered} {modality} {label} top logprobs")
    # Greedy picks the model's most likely token at every step.
    greedy_choice = results[0].choices[0]
    assert [top[0][1] for top in greedy_choice.top_logprobs] == pytest.approx(greedy_choice.logprobs, abs=1e-6)

    prompt_lp = results[0].prompt_logprobs
    assert prompt_lp[0] is None
    assert_close(prompt_lp[1:], reference.prompt_logprobs(prompt.token_ids, prompt.items),
                 f"{registered} {modality} prompt logprobs")


@pytest.mark.parametrize(("registered", "modality"), list(registry_cases()))
def test_scoring_is_the_models_own_alone_and_in_a_mixed_batch(registered, modality, arch_setup):
    engine, processor, reference = arch_setup(registered)
    tokens = processor.tokenizer
    main = make_prompt(processor, modality)
    completion = tokens(" a red square on a blue background", add_special_tokens=False)["input_ids"]
    alone = engine.score([ScoreRequest(main.token_ids, completion, items=main.items)])[0]
    want = reference.token_logprobs(main.token_ids, completion, main.items)
    assert_close(alone.logprobs, want, f"{registered} {modality} score alone")

    # Rows of other lengths and other media in one forward: every modality this model takes.
    others = [make_prompt(processor, other, variant=1, text="Answer with one word.")
              for other in ("text", *sorted(processor.modalities))]
    batch = [ScoreRequest(main.token_ids, completion, items=main.items)]
    batch += [ScoreRequest(p.token_ids, tokens(" yes" * (i + 1), add_special_tokens=False)["input_ids"], items=p.items)
              for i, p in enumerate(others)]
    scored = engine.score(batch)
    assert_close(scored[0].logprobs, want, f"{registered} {modality} score in a mixed batch")
    for request, prompt, result in zip(batch[1:], others, scored[1:], strict=True):
        assert_close(result.logprobs, reference.token_logprobs(prompt.token_ids, request.completion_token_ids,
                                                               prompt.items),
                     f"{registered} {modality} mixed batch row")


@pytest.mark.parametrize(("registered", "modality"), list(registry_cases()))
def test_a_seeded_request_gives_the_same_tokens_alone_and_amid_churn(registered, modality, arch_setup):
    """The same seeded request alone and among 40 others joining and leaving (other lengths, other
    media, greedy and seeded), on a KV pool whose every free block holds NaN, gives the same tokens
    and logprobs, which are the model's own."""
    engine, processor, reference = arch_setup(registered)
    prompt = make_prompt(processor, modality, text="What colour is it?")
    target = GenerationRequest(prompt.token_ids, SamplingParams(max_tokens=6, temperature=1.0, seed=1234,
                                                                ignore_eos=True), items=prompt.items)
    alone = engine.generate([target])[0].choices[0]

    kinds = ("text", *sorted(processor.modalities))
    variants = {(kind, v): make_prompt(processor, kind, variant=v, text="Answer with one word.")
                for kind in kinds for v in (0, 1)}
    others = []
    for i in range(40):
        other = variants[(kinds[i % len(kinds)], i % 2)]
        params = SamplingParams(max_tokens=1 + i % 7, temperature=0 if i % 3 == 0 else 0.9, seed=100 + i,
                                ignore_eos=True)
        others.append(GenerationRequest(other.token_ids, params, items=other.items))

    poison_free_blocks(engine)  # what a bad request can leave behind must not reach this one
    scheduler = engine.scheduler(limits=SchedulerLimits(max_rows=6, prompt_cache_tokens=0))
    pending = [(f"other-{i}", r) for i, r in enumerate(others)]
    pending.insert(17, ("target", target))
    results, rows_seen = {}, set()
    while pending or scheduler.has_work:
        for tag, request in pending[:3]:  # a few join every step
            scheduler.submit(request, tag=tag)
        del pending[:3]
        rows_seen.add(scheduler.free_rows)
        for finished in scheduler.step():
            assert finished.error is None, finished.error
            results[finished.tag] = finished.result
    assert len(rows_seen) > 2  # the batch grew and shrank around the target
    churned = results["target"].choices[0]
    assert churned.token_ids == alone.token_ids, f"{registered} {modality}: seeded tokens changed amid churn"
    assert_close(churned.logprobs, alone.logprobs, f"{registered} {modality} seeded logprobs amid churn")
    assert_close(churned.logprobs, reference.token_logprobs(prompt.token_ids, churned.token_ids, prompt.items),
                 f"{registered} {modality} seeded logprobs amid churn vs the forward")


@pytest.mark.parametrize(("registered", "modality"), list(registry_cases()))
def test_a_cached_prefix_gives_the_models_own_logprobs(registered, modality, arch_setup):
    """Prefix reuse (engine/prefix_hash.py): a request whose first KV blocks were computed by an
    earlier one (its prefill, and the tokens it decoded) gives the model's own numbers, media in the
    cached part (a next turn after an image) or after it (media behind a cached text prefix)."""
    engine, processor, reference = arch_setup(registered)
    engine.forget_cached()
    size = engine.kv_pool.block_size
    tokens = processor.tokenizer
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, ignore_eos=True, top_logprobs=TOP)

    # A next turn: the prompt, its completion, then more text. Its cached part holds the media.
    prompt = make_prompt(processor, modality, text="What colour is it?")
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    [first] = engine.generate([GenerationRequest(prompt.token_ids, greedy, items=prompt.items)])[0].choices
    turn = [*prompt.token_ids, *first.token_ids, *tokens(" Then say it again, slowly.", add_special_tokens=False)["input_ids"]]
    second = engine.generate([GenerationRequest(turn, params, items=prompt.items)])[0]
    assert second.cached_tokens == (len(prompt.token_ids) + len(first.token_ids) - 1) // size * size > 0
    [choice] = second.choices
    assert_close(choice.logprobs, reference.token_logprobs(turn, choice.token_ids, prompt.items),
                 f"{registered} {modality} next turn after a cached prefix")
    assert_top_logprobs(choice.top_logprobs, reference, turn, choice.token_ids, prompt.items, TOP,
                        f"{registered} {modality} next turn top logprobs")

    # Media after a cached text prefix: the part computed holds all of it, positions continued.
    system = tokens("You are a careful assistant. Look closely and answer in one short sentence. " * 2,
                    add_special_tokens=False)["input_ids"]
    engine.generate([GenerationRequest(system, dataclasses.replace(greedy, max_tokens=1))])
    shifted = [dataclasses.replace(item, offset=(item.offset[0] + len(system), item.offset[1] + len(system)))
               for item in prompt.items]
    full = [*system, *prompt.token_ids]
    after = engine.generate([GenerationRequest(full, params, items=shifted)])[0]
    assert after.cached_tokens == len(system) // size * size > 0
    [choice] = after.choices
    assert_close(choice.logprobs, reference.token_logprobs(full, choice.token_ids, shifted),
                 f"{registered} {modality} media after a cached text prefix")


@pytest.fixture(scope="session")
def next_weights(tmp_path_factory, fidelity_dirs):
    """``next_weights(registered)``: the same architecture with other random weights (an RL step's
    checkpoint), built once per architecture."""
    from engine.demo_model import build_demo_model

    root, built = tmp_path_factory.mktemp("fidelity-next-weights"), {}

    def make(registered):
        if registered not in built:
            arch = demo_dir_for(fidelity_dirs, registered).name  # demo_dirs builds each under its arch
            built[registered] = build_demo_model(root / arch, arch=arch, seed=1)
        return built[registered]

    return make


@pytest.mark.parametrize(("registered", "modality"), list(registry_cases()))
def test_a_row_kept_across_an_update_with_recompute_gives_each_versions_own_logprobs(registered, modality, arch_setup,
                                                                                     fidelity_dirs, next_weights):
    """Issue #51: a row decoding when the weights change (update mode keep, ``recompute_kv``) goes on
    under the new ones; its tokens before the update are the old model's forward, those after the new
    model's over the whole sequence (media and M-RoPE positions included), and its spans say which."""
    _, processor, old_reference = arch_setup(registered)
    directory, new_directory = demo_dir_for(fidelity_dirs, registered), next_weights(registered)
    engine = Engine(load_model(str(directory), device="cpu"))  # its own: the update changes it
    prompt = make_prompt(processor, modality)
    at, tokens = 3, 7
    scheduler = engine.scheduler()
    handle = scheduler.submit(GenerationRequest(
        prompt.token_ids, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), items=prompt.items))
    finished = []
    while not finished and len(scheduler.tokens_so_far(handle)[0].token_ids) < at:
        finished = scheduler.step()
    assert not finished
    old_version = engine.weight_version
    engine.update_weights(new_directory, weight_version="step-1")
    scheduler.weights_changed(recompute_kv=True)
    while not finished:
        finished = scheduler.step()
    [choice] = finished[0].result.choices
    assert choice.weight_versions == [{"version": old_version, "start": 0, "end": at},
                                      {"version": "step-1", "start": at, "end": tokens}]
    new_reference = Reference(new_directory, processor.hf)
    want = (old_reference.token_logprobs(prompt.token_ids, choice.token_ids, prompt.items)[:at]
            + new_reference.token_logprobs(prompt.token_ids, choice.token_ids, prompt.items)[at:])
    assert_close(choice.logprobs, want, f"{registered} {modality} logprobs across an update")
