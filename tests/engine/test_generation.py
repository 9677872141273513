"""Batched generation on the demo Qwen2-VL (fp32, CPU): determinism, per-row params, stopping."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.errors import ContextLengthError, Fault, InvalidRequestError, PlaceholderMismatchError
from engine.generation import Engine, GenerationRequest
from engine.items import MultimodalItem
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def sampled(seed=7, **kw):
    return SamplingParams(**{"max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": seed, **kw})


def tokens(result, choice=0):
    return result.choices[choice].token_ids


@pytest.fixture(scope="module")
def mixed(prompts):
    """Requests of different lengths, text and image, used as batch neighbours."""
    image = prompts.image_features()
    return [
        GenerationRequest(prompts.text("The image shows a kitchen with a wooden table, two chairs, a window "
                                       "and a plant on the shelf. Count the objects."), GREEDY),
        GenerationRequest(prompts.image_prompt("Describe the image.", image), sampled(seed=1, n=2),
                          mm_kwargs=image),
        GenerationRequest(prompts.text("Yes."), sampled(seed=2, top_k=20)),
    ]


def test_greedy_is_deterministic_and_reports_the_contract(engine, prompts):
    request = GenerationRequest(prompts.text("The quick brown fox"), GREEDY)
    first, second = engine.generate([request]), engine.generate([request])
    assert tokens(first[0]) == tokens(second[0])
    result = first[0]
    assert result.prompt_token_ids == list(request.prompt_token_ids)
    assert result.usage == {"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": 8}
    assert result.weight_version == engine.weight_version
    assert set(result.timings) >= {"prefill_s", "decode_s"}
    assert result.choices[0].finish_reason == "length"
    assert result.choices[0].index == 0


@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_request_gives_the_same_tokens_alone_and_in_a_batch(engine, mixed, which):
    assert len(mixed[0].prompt_token_ids) > len(mixed[1].prompt_token_ids) + 5  # the image row is padded
    alone = engine.generate([mixed[which]])[0]
    batched = engine.generate(mixed)[which]
    assert [c.token_ids for c in alone.choices] == [c.token_ids for c in batched.choices]
    # Padding changes the logits only by float rounding (~1e-7 measured).
    for a, b in zip(alone.choices, batched.choices, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_batch_order_does_not_matter(engine, mixed):
    forward = engine.generate(mixed)
    backward = engine.generate(mixed[::-1])[::-1]
    assert [tokens(r) for r in forward] == [tokens(r) for r in backward]


def test_seeds_reproduce_and_differ(engine, prompts):
    prompt = prompts.text("The weather today is")
    a, b, c = engine.generate([
        GenerationRequest(prompt, sampled(seed=11)),
        GenerationRequest(prompt, sampled(seed=11)),
        GenerationRequest(prompt, sampled(seed=12)),
    ])
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)
    unseeded = engine.generate([GenerationRequest(prompt, sampled(seed=None))] * 2)
    assert tokens(unseeded[0]) != tokens(unseeded[1])


def test_n_expands_into_distinct_choices_and_choice_0_matches_n_1(engine, prompts):
    prompt = prompts.text("A man is riding")
    many = engine.generate([GenerationRequest(prompt, sampled(seed=5, n=3))])[0]
    one = engine.generate([GenerationRequest(prompt, sampled(seed=5))])[0]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.choices}) == 3
    assert tokens(many, 0) == tokens(one)
    assert many.usage["completion_tokens"] == 24


@pytest.mark.parametrize("params", [
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, min_p=1.0),
    dict(temperature=1.0, top_p=1e-6),
    dict(temperature=1e-4),
])
def test_truncation_to_one_token_equals_greedy(engine, prompts, params):
    prompt = prompts.text("Please answer briefly.")
    greedy = engine.generate([GenerationRequest(prompt, GREEDY)])[0]
    narrow = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=8, seed=3, **params))])[0]
    assert tokens(narrow) == tokens(greedy)
    # logprobs are of the raw distribution, not of the truncated one (which would be 0).
    torch.testing.assert_close(narrow.choices[0].logprobs, greedy.choices[0].logprobs)


def test_logprobs_are_finite_one_per_token_and_optional(engine, prompts):
    prompt = prompts.text("Mathematics: if x + 2 = 5")
    with_lp, without = engine.generate([
        GenerationRequest(prompt, sampled(seed=1, max_tokens=6)),
        GenerationRequest(prompt, sampled(seed=1, max_tokens=6, logprobs=False)),
    ])
    logprobs = with_lp.choices[0].logprobs
    assert len(logprobs) == len(tokens(with_lp)) == 6
    assert all(math.isfinite(x) and x <= 0 for x in logprobs)
    assert without.choices[0].logprobs is None
    assert tokens(without) == tokens(with_lp)


def test_max_tokens_per_row_ends_with_length(engine, prompts):
    prompt = prompts.text("Code: def f(x):")
    short, long = engine.generate([
        GenerationRequest(prompt, dataclasses.replace(GREEDY, max_tokens=3)),
        GenerationRequest(prompt, dataclasses.replace(GREEDY, max_tokens=9)),
    ])
    assert len(tokens(short)) == 3 and len(tokens(long)) == 9
    assert tokens(long)[:3] == tokens(short)
    assert short.choices[0].finish_reason == long.choices[0].finish_reason == "length"


def test_stop_token_ids_end_a_row_and_keep_the_stop_token(engine, prompts):
    prompt = prompts.text("User: what is in this photo?")
    free = tokens(engine.generate([GenerationRequest(prompt, dataclasses.replace(GREEDY, max_tokens=12))])[0])
    stop = free[4]
    cut = free[: free.index(stop) + 1]
    stopped, other = engine.generate([
        GenerationRequest(prompt, dataclasses.replace(GREEDY, max_tokens=12, stop_token_ids=[stop])),
        GenerationRequest(prompts.text("Numbers:"), dataclasses.replace(GREEDY, max_tokens=12)),
    ])
    assert tokens(stopped) == cut
    assert stopped.choices[0].finish_reason == "stop"
    assert len(stopped.choices[0].logprobs) == len(cut)
    assert len(tokens(other)) == 12  # the neighbour runs on


def test_eos_stops_unless_ignore_eos(loaded, prompts):
    prompt = prompts.text("Rollouts are scored offline")
    free = tokens(Engine(loaded).generate([GenerationRequest(prompt, GREEDY)])[0])
    # Pretend the third greedy token is the model's eos.
    engine = Engine(dataclasses.replace(loaded, eos_token_ids=(free[2],)))
    stops, ignores = engine.generate([
        GenerationRequest(prompt, GREEDY),
        GenerationRequest(prompt, dataclasses.replace(GREEDY, ignore_eos=True)),
    ])
    assert tokens(stops) == free[: free.index(free[2]) + 1]
    assert stops.choices[0].finish_reason == "stop"
    assert tokens(ignores) == free and ignores.choices[0].finish_reason == "length"


def test_abort_ends_the_chosen_requests_with_the_tokens_so_far(engine, prompts):
    calls = []

    def should_abort():
        calls.append(1)
        return {1} if len(calls) > 3 else set()

    requests = [
        GenerationRequest(prompts.text("The image shows a kitchen"), dataclasses.replace(GREEDY, max_tokens=10)),
        GenerationRequest(prompts.text("How many cats"), sampled(seed=3, max_tokens=10, n=2)),
    ]
    kept, aborted = engine.generate(requests, should_abort=should_abort)
    assert kept.choices[0].finish_reason == "length" and len(tokens(kept)) == 10
    assert [c.finish_reason for c in aborted.choices] == ["abort", "abort"]
    assert 0 < len(tokens(aborted)) < 10
    full = engine.generate([requests[1]])[0]
    assert tokens(full)[: len(tokens(aborted))] == tokens(aborted)


def test_abort_keeps_tokens_when_the_caller_grows_one_set(engine, prompts):
    """The GPU task's should_abort returns the same set each poll, adding to it as cancels arrive:
    a row aborted mid-decode keeps its tokens so far (it was once emptied, as if never started)."""
    calls, aborted = [], set()

    def should_abort():
        calls.append(1)
        if len(calls) > 3:
            aborted.add(0)
        return aborted

    (result,) = engine.generate([GenerationRequest(prompts.text("How many cats"),
                                                   dataclasses.replace(GREEDY, max_tokens=10))],
                                should_abort=should_abort)
    assert result.choices[0].finish_reason == "abort" and 0 < len(tokens(result)) < 10
    assert len(result.choices[0].logprobs) == len(tokens(result))


def test_abort_before_start_skips_the_request(engine, prompts):
    requests = [
        GenerationRequest(prompts.text("Yes."), GREEDY),
        GenerationRequest(prompts.text("No."), GREEDY),
    ]
    skipped, ran = engine.generate(requests, should_abort=lambda: {0})
    assert skipped.choices[0].token_ids == [] and skipped.choices[0].finish_reason == "abort"
    assert ran.choices[0].finish_reason == "length"


def test_context_length_is_checked_before_running(engine, loaded, prompts):
    too_long = [7] * (loaded.context_tokens - 4)
    with pytest.raises(ContextLengthError) as info:
        engine.generate([
            GenerationRequest(prompts.text("fine"), GREEDY),
            GenerationRequest(too_long, dataclasses.replace(GREEDY, max_tokens=5)),
        ])
    assert info.value.fault is Fault.INVALID and info.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError):
        engine.generate([GenerationRequest([], GREEDY)])


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(max_tokens=True), dict(temperature=-1.0), dict(temperature=float("nan")),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=2.0), dict(n=0), dict(seed=-1),
    dict(stop_token_ids=[-3]), dict(ignore_eos="yes"),
])
def test_sampling_params_are_validated(bad):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**bad)
    assert set(info.value.errors) == set(bad)


def test_image_prompt_generates_and_items_match_mm_kwargs(engine, prompts):
    image = prompts.image_features()
    prompt = prompts.image_prompt("Describe the image.", image)
    start = prompt.index(prompts.config.image_token_id)
    item = MultimodalItem("image", features=image, offset=(start, start + 4))
    by_kwargs, by_items, red_vs_blue = engine.generate([
        GenerationRequest(prompt, GREEDY, mm_kwargs=image),
        GenerationRequest(prompt, GREEDY, items=[item]),
        GenerationRequest(prompt, GREEDY, mm_kwargs=prompts.image_features(color="blue")),
    ])
    assert image["pixel_values"].shape == (16, 1176)
    assert tokens(by_kwargs) == tokens(by_items)
    assert by_kwargs.placeholder_ranges == by_items.placeholder_ranges == [
        {"modality": "image", "offset": start, "length": 4}]
    assert by_kwargs.choices[0].logprobs != red_vs_blue.choices[0].logprobs  # the image is seen


def test_several_images_keep_their_order_in_a_batch(engine, prompts):
    small, wide, tall = (prompts.image_features((64, 48)), prompts.image_features((112, 56), "green"),
                         prompts.image_features((56, 112), "blue"))
    two = {k: torch.cat([small[k], wide[k]]) for k in small}
    requests = [
        GenerationRequest(prompts.image_tokens(small) + prompts.text(" and ") + prompts.image_tokens(wide),
                          sampled(seed=9), mm_kwargs=two),
        GenerationRequest(prompts.text("Text only."), GREEDY),
        GenerationRequest(prompts.image_prompt("What colour?", tall), GREEDY, mm_kwargs=tall),
    ]
    batched = engine.generate(requests)
    for request, result in zip(requests, batched, strict=True):
        assert tokens(engine.generate([request])[0]) == tokens(result)


def test_placeholders_and_media_must_come_together(engine, prompts):
    image = prompts.image_features()
    with pytest.raises(PlaceholderMismatchError):  # placeholders, no media
        engine.generate([GenerationRequest(prompts.image_prompt("Hi", image), GREEDY)])
    with pytest.raises(PlaceholderMismatchError):  # media, no placeholders
        engine.generate([GenerationRequest(prompts.text("Hi"), GREEDY, mm_kwargs=image)])


@pytest.mark.gpu
def test_generation_on_cuda_matches_batch_and_scoring(demo_model_dir, prompts):
    from engine.loading import load_model
    from engine.scoring import ScoreRequest

    engine = Engine(load_model(str(demo_model_dir), device="cuda"))
    image = prompts.image_features()
    requests = [
        GenerationRequest(prompts.image_prompt("Describe the image.", image), GREEDY, mm_kwargs=image),
        GenerationRequest(prompts.text("The quick brown fox"), sampled(seed=4, n=2)),
    ]
    batched = engine.generate(requests)
    assert tokens(engine.generate(requests[:1])[0]) == tokens(batched[0])
    scored = engine.score([ScoreRequest(r.prompt_token_ids, tokens(b), mm_kwargs=r.mm_kwargs)
                           for r, b in zip(requests, batched, strict=True)])
    for b, s in zip(batched, scored, strict=True):
        torch.testing.assert_close(b.choices[0].logprobs, s.logprobs, atol=1e-3, rtol=0)
