"""Sampling masks and processed logprobs (engine/processed_rows.py, engine/sampling_mask.py), each
against transformers' own logits warpers applied to one row at a time: the support a token was
drawn from, and its logprob under that renormalized distribution. Raw mode stays as it was."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from engine.batch_sampler import sample_step
from engine.decoding import RowDecoder
from engine.errors import InvalidRequestError
from engine.generation import GenerationRequest
from engine.sampling_mask import unpack
from engine.sampling_params import SamplingParams

EOS = 7


def reference(logits: torch.Tensor, params: SamplingParams, banned=()) -> torch.Tensor:
    """The processed logprobs (vocab,) of one row: ``banned`` ids at -inf (min_tokens, media
    placeholders), then transformers' temperature, top-k, top-p and min-p warpers; a greedy
    row's is a point mass at its argmax."""
    scores = logits.clone().float()[None]
    if banned:
        scores[0, list(banned)] = -math.inf
    if params.greedy:
        return torch.where(torch.arange(scores.shape[-1]) == scores.argmax(), 0.0, -math.inf)
    warpers = [TemperatureLogitsWarper(params.temperature)]
    warpers += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    warpers += [MinPLogitsWarper(params.min_p)] if params.min_p else []
    for warper in warpers:
        scores = warper(torch.zeros((1, 1), dtype=torch.long), scores)
    return torch.log_softmax(scores, dim=-1)[0]


def steps_of(mask: dict) -> list[list[int]]:
    """Each token's support from a CSR mask (an engine choice's is packed, as results store it)."""
    mask = unpack(mask)
    ids, offsets = mask["token_ids"], mask["offsets"]
    return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def support(logprobs: torch.Tensor) -> list[int]:
    return torch.nonzero(logprobs.exp() > 0)[:, 0].tolist()


def decoder(seed: int | None, **params) -> RowDecoder:
    sampling = SamplingParams(max_tokens=8, ignore_eos=True, seed=seed, **params)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return RowDecoder(0, 0, sampling, generator, eos_token_ids=frozenset({EOS}))


def step(rows, logits):
    jobs = [SimpleNamespace(tag=i, peak_rows=0, first_token_at=None) for i in range(len(rows))]
    failed = []
    sample_step(rows, jobs, logits, placeholder_ids=None, events=[], batch_rows=len(rows),
                fail=lambda job, error: failed.append(error))
    assert failed == []


KNOBS = [  # one batch, every row its own knobs
    dict(temperature=0.7, top_k=5, sampling_mask=True, logprobs_mode="processed"),
    dict(temperature=1.0, top_p=0.8, sampling_mask=True, logprobs_mode="processed"),
    dict(temperature=1.3, min_p=0.1, sampling_mask=True, logprobs_mode="processed"),
    dict(temperature=0.5, top_k=40, top_p=0.9, min_p=0.05, sampling_mask=True, logprobs_mode="processed"),
    dict(temperature=0, sampling_mask=True, logprobs_mode="processed"),
    dict(temperature=0.9, top_p=0.7, min_tokens=8, sampling_mask=True, logprobs_mode="processed"),  # eos masked
    dict(temperature=1.0, top_k=12, sampling_mask=True),  # raw logprobs, with a mask
    dict(temperature=0.8, top_p=0.6, logprobs_mode="processed"),  # processed logprobs, no mask
    dict(temperature=1.0, top_p=0.9),  # neither
]


def test_each_row_of_a_batch_gets_its_own_mask_and_processed_logprob():
    torch.manual_seed(0)
    rows = [decoder(seed if seed % 2 else None, **knobs) for seed, knobs in enumerate(KNOBS)]
    seen = [torch.randn(len(KNOBS), 500) * 3 for _ in range(4)]
    for logits in seen:
        step(rows, logits)
    for i, row in enumerate(rows):
        params, masks = row.params, row.sampling_mask()
        assert (masks is None) == (not params.sampling_mask)
        if masks is not None:
            assert len(masks["offsets"]) == len(row.token_ids) + 1 and masks["offsets"][0] == 0
        for k, (logits, token) in enumerate(zip(seen, row.token_ids, strict=True)):
            expected = reference(logits[i], params, banned=(EOS,) if params.min_tokens > k else ())
            if masks is not None:
                assert steps_of(masks)[k] == support(expected), (i, k)
                assert token in steps_of(masks)[k]
            assert math.isfinite(float(expected[token]))  # drawn from the support
            if params.logprobs_mode == "processed":
                assert row.logprobs()[k] == pytest.approx(float(expected[token]), abs=1e-5)
            else:
                assert row.logprobs()[k] == float(torch.log_softmax(logits[i], -1)[token])


def test_a_greedy_row_s_support_is_its_token_at_logprob_zero():
    row = decoder(None, temperature=0, sampling_mask=True, logprobs_mode="processed", top_logprobs=3)
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    step([row], logits)
    step([row], logits.flip(-1))
    assert row.token_ids == [1, 2]
    assert row.sampling_mask() == {"token_ids": [1, 2], "offsets": [0, 1, 2]}
    assert row.logprobs() == [0.0, 0.0]
    assert row.top_logprobs() == [[[1, 0.0]], [[2, 0.0]]]  # a point mass lists its token alone


def test_processed_top_logprobs_are_the_processed_distributions_top_k_within_its_support():
    torch.manual_seed(1)
    logits = torch.randn(2, 200) * 2
    knobs = dict(temperature=0.6, top_k=3, top_logprobs=5)
    rows = [decoder(3, logprobs_mode="processed", **knobs), decoder(3, **knobs)]
    step(rows, logits)
    processed, raw = rows[0].top_logprobs()[0], rows[1].top_logprobs()[0]
    expected = reference(logits[0], rows[0].params)
    values, ids = torch.topk(expected, 3)  # only 3 tokens can be drawn
    assert [t for t, _ in processed] == ids.tolist()
    torch.testing.assert_close([v for _, v in processed], values.tolist(), atol=1e-5, rtol=0)
    values, ids = torch.topk(torch.log_softmax(logits[1], -1), 5)
    assert raw == [[t, v] for t, v in zip(ids.tolist(), values.tolist(), strict=True)]


def test_asking_for_masks_changes_no_token_and_no_raw_logprob():
    torch.manual_seed(2)
    seen = [torch.randn(4, 300) * 3 for _ in range(5)]
    knobs = [dict(temperature=0.9, top_p=0.9, top_logprobs=4), dict(temperature=0.6, top_k=20),
             dict(temperature=0, top_logprobs=2), dict(temperature=1.1, min_p=0.05)]

    def run(**extra):
        rows = [decoder(10 + i, **knob, **extra) for i, knob in enumerate(knobs)]
        torch.manual_seed(3)  # the unseeded rows' shared draw
        for logits in seen:
            step(rows, logits)
        return rows

    plain, masked = run(), run(sampling_mask=True)
    processed = run(sampling_mask=True, logprobs_mode="processed")
    for a, b, c in zip(plain, masked, processed, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs() == b.logprobs() and a.top_logprobs() == b.top_logprobs()  # bit for bit
        assert a.sampling_mask() is None and b.sampling_mask() == c.sampling_mask()


def test_mask_and_logprobs_mode_are_validated():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logprobs_mode="processed_logprobs", sampling_mask=1)
    assert set(info.value.errors) == {"logprobs_mode", "sampling_mask"}
    assert info.value.code == InvalidRequestError.code
    assert not SamplingParams().processed and SamplingParams().logprobs_mode == "raw"


def next_logits(loaded, token_ids) -> torch.Tensor:
    """The raw fp32 logits after ``token_ids``, from a plain forward pass of one row."""
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([list(token_ids)])).logits[0, -1].float()


# A top-k of 40 keeps each top-p and min-p cut among few, well-separated tokens, so the
# teacher-forced forward's last-bit differences from the decoding forward cannot move it.
MODEL_KNOBS = [
    dict(temperature=0.5, top_k=40, top_p=0.8, seed=1, logprobs_mode="processed", top_logprobs=3),
    dict(temperature=1.0, top_k=40, min_p=0.3, seed=2),
    dict(temperature=0.8, top_k=7, seed=3, logprobs_mode="processed"),
    dict(temperature=0, logprobs_mode="processed"),
    dict(temperature=0.7, top_k=40, top_p=0.6, min_p=0.1, n=2, seed=4),
]


def test_a_batch_on_a_real_model_masks_each_token_as_transformers_warpers_do(models):
    model = models("text")
    engine = model.engine()
    prompts = ["The weather today is", "Once upon a time", "1, 2, 3,", "Hello", "A man is riding"]

    def requests(**extra):
        return [model.request(text, SamplingParams(max_tokens=6, ignore_eos=True, **knobs, **extra))
                for text, knobs in zip(prompts, MODEL_KNOBS, strict=True)]

    plain, masked = engine.generate(requests()), engine.generate(requests(sampling_mask=True))
    for text, knobs, free, result in zip(prompts, MODEL_KNOBS, plain, masked, strict=True):
        params = SamplingParams(**knobs)
        prompt = model.text(text)
        for a, choice in zip(free.choices, result.choices, strict=True):
            assert choice.token_ids == a.token_ids and choice.logprobs == a.logprobs  # the mask changes nothing
            assert a.sampling_mask is None
            for k, token in enumerate(choice.token_ids):
                expected = reference(next_logits(model.loaded, prompt + choice.token_ids[:k]), params)
                mask = steps_of(choice.sampling_mask)[k]
                assert mask == support(expected) and token in mask
                if params.logprobs_mode == "processed":
                    assert choice.logprobs[k] == pytest.approx(float(expected[token]), abs=1e-4)
                    if params.top_logprobs:
                        assert len(choice.top_logprobs[k]) == min(params.top_logprobs, len(mask))


def test_no_mask_holds_a_media_placeholder(engine, loaded, prompts):
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=5, sampling_mask=True, logprobs_mode="processed")
    prompt = prompts.text("User: what is in this photo?")
    choice = engine.generate([GenerationRequest(prompt, params)])[0].choices[0]
    config = loaded.model.config
    placeholders = {config.image_token_id, config.video_token_id}
    for k, mask in enumerate(steps_of(choice.sampling_mask)):
        logits = next_logits(loaded, prompt + choice.token_ids[:k])
        expected = reference(logits, params, banned=placeholders)
        assert mask == support(expected) and not placeholders & set(mask)
        assert len(mask) == logits.shape[-1] - len(placeholders)  # no truncation: all the rest
        assert choice.logprobs[k] == pytest.approx(float(expected[choice.token_ids[k]]), abs=1e-4)


def test_a_seeded_request_draws_the_same_tokens_with_and_without_its_mask(engine, prompts):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11, n=2, top_logprobs=2)
    prompt = prompts.text("A man is riding")
    plain = engine.generate([GenerationRequest(prompt, params)])[0]
    masked = engine.generate([GenerationRequest(prompt, dataclasses.replace(params, sampling_mask=True))])[0]
    for a, b in zip(plain.choices, masked.choices, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
        assert len(unpack(b.sampling_mask)["offsets"]) == len(b.token_ids) + 1


def test_draw_rows_hands_back_each_row_s_processed_distribution():
    from engine.sampling import draw_rows

    torch.manual_seed(4)
    logits = torch.randn(3, 100) * 2
    params = [SamplingParams(temperature=0.8, top_p=0.7, min_p=0.05), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_k=9)]
    draw = draw_rows(logits, params, [None] * 3)
    for i, p in enumerate(params):
        expected = reference(logits[i], p).exp()
        torch.testing.assert_close(draw.probs[i] / draw.probs[i].sum(), expected, atol=1e-6, rtol=0)
        assert draw.probs[i, draw.tokens[i]] > 0


def test_greedy_and_sampled_rows_of_one_step_each_get_their_processed_top_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(3, 50) * 2
    knobs = dict(logprobs_mode="processed", top_logprobs=3)
    rows = [decoder(None, temperature=0, **knobs), decoder(6, temperature=0.9, top_k=2, sampling_mask=True, **knobs),
            decoder(7, temperature=1.0, top_p=0.95, **knobs)]
    step(rows, logits)
    for i, row in enumerate(rows):
        expected = reference(logits[i], row.params)
        values, ids = torch.topk(expected, min(3, len(support(expected))))
        assert [t for t, _ in row.top_logprobs()[0]] == ids.tolist()
        torch.testing.assert_close([v for _, v in row.top_logprobs()[0]], values.tolist(), atol=1e-5, rtol=0)
        assert row.logprobs()[0] == pytest.approx(float(expected[row.token_ids[0]]), abs=1e-5)
    assert steps_of(rows[1].sampling_mask()) == [support(reference(logits[1], rows[1].params))]
