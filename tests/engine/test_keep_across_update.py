"""Rows that live through a weight swap (update mode keep, engine/weight_crossing.py) on the
demo model: each token's logprob is the forward of the weights its span names, computed here with
transformers directly. Without recompute_kv a token after the swap is the new weights' forward
attending to the KV the old weights computed (a cache from the old model, then the new model over
the tokens after it); with recompute_kv, the new weights' forward over the whole sequence."""

from __future__ import annotations

import pytest

from engine.demo_model import build_demo_model
from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams
from tests.version_refs import old_kv_then_new, teacher_forced

TOKENS, AT = 10, 4  # a row of TOKENS tokens; the swap lands when it has AT
ATOL = 2e-5


@pytest.fixture(scope="module")
def new_weights_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("weights") / "demo-seed-1", seed=1)


@pytest.fixture(scope="module")
def models(demo_model_dir, new_weights_dir):
    """The old and the new weights as plain transformers models (the references)."""
    old = load_model(str(demo_model_dir), device="cpu").model.eval()
    new = load_model(str(new_weights_dir), device="cpu").model.eval()
    return old, new


def _run_across(engine: Engine, new_dir, request: GenerationRequest, *, recompute_kv: bool):
    scheduler = engine.scheduler()
    handle = scheduler.submit(request)
    finished = []
    while not finished and len(scheduler.tokens_so_far(handle)[0].token_ids) < AT:
        finished = scheduler.step()
    if not finished:
        engine.update_weights(new_dir, weight_version="step-1")
        scheduler.weights_changed(recompute_kv=recompute_kv)
        while not finished:
            finished = scheduler.step()
    [item] = finished
    return item.result


def _request(prompt, **params) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=True,
                                                    **params), cache_scope="k")


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_a_kept_row_continues_on_the_new_weights_and_its_spans_name_them(demo_model_dir, new_weights_dir, models,
                                                                          prompts, recompute_kv):
    old, new = models
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    first = engine.weight_version
    # Longer than a KV block: recompute_kv prefills the prompt, then the row after its full blocks.
    prompt = prompts.text("The quick brown fox jumps over the lazy dog, " * 4)
    assert len(prompt) > engine.kv_pool.block_size
    result = _run_across(engine, new_weights_dir, _request(prompt), recompute_kv=recompute_kv)

    [choice] = result.choices
    tokens = choice.token_ids
    assert len(tokens) == TOKENS and choice.finish_reason == "length"
    assert choice.weight_versions == [{"version": first, "start": 0, "end": AT},
                                      {"version": "step-1", "start": AT, "end": TOKENS}]
    assert result.weight_version == "step-1" and choice.kv_recomputed is recompute_kv
    before = teacher_forced(old, prompt, tokens)[:AT]
    after = (teacher_forced(new, prompt, tokens)[AT:] if recompute_kv
             else old_kv_then_new(old, new, prompt, tokens, AT))
    assert choice.logprobs == pytest.approx(before + after, abs=ATOL)
    # Greedy: each token is the argmax of the forward that made it (not the other version's).
    mixed = old_kv_then_new(old, new, prompt, tokens, AT)
    fresh = teacher_forced(new, prompt, tokens)[AT:]
    assert (mixed != pytest.approx(fresh, abs=1e-3)) or recompute_kv


def test_a_row_past_its_policy_lag_ends_at_the_swap_with_no_token_of_the_new_weights(demo_model_dir, new_weights_dir,
                                                                                       models, prompts):
    old, _ = models
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    first = engine.weight_version
    prompt = prompts.text("The quick brown fox jumps")
    result = _run_across(engine, new_weights_dir, _request(prompt, max_policy_lag=0), recompute_kv=False)

    [choice] = result.choices
    assert choice.finish_reason == "policy_lag" and len(choice.token_ids) == AT
    assert choice.weight_versions == [{"version": first, "start": 0, "end": AT}] and result.weight_version == first
    assert choice.logprobs == pytest.approx(teacher_forced(old, prompt, choice.token_ids), abs=ATOL)


def test_a_lag_of_one_crosses_one_update(demo_model_dir, new_weights_dir, prompts):
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    prompt = prompts.text("The quick brown fox jumps")
    result = _run_across(engine, new_weights_dir, _request(prompt, max_policy_lag=1), recompute_kv=False)
    assert result.choices[0].finish_reason == "length" and len(result.choices[0].weight_versions) == 2


def test_no_block_the_old_weights_computed_is_found_under_the_new_ones(demo_model_dir, new_weights_dir, models,
                                                                       prompts):
    """A kept row holds its old blocks to its end; neither they nor its prompt's are found after it."""
    _, new = models
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    prompt = prompts.text("The quick brown fox jumps over the lazy dog and runs far away")
    kept = _run_across(engine, new_weights_dir, _request(prompt), recompute_kv=False)
    tokens = kept.choices[0].token_ids
    # The same prompt, and a next turn repeating the kept row's tokens, under the new weights.
    [again, turn] = engine.generate([_request(prompt), _request(prompt + tokens)])
    assert again.cached_tokens == 0 and turn.cached_tokens == 0
    assert again.choices[0].weight_versions == [{"version": "step-1", "start": 0, "end": TOKENS}]
    assert again.choices[0].logprobs == pytest.approx(
        teacher_forced(new, prompt, again.choices[0].token_ids), abs=ATOL)


def test_a_request_waiting_at_the_swap_runs_wholly_on_the_new_weights(demo_model_dir, new_weights_dir, models,
                                                                      prompts):
    _, new = models
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    scheduler = engine.scheduler()
    prompt = prompts.text("The quick brown fox jumps")
    handle = scheduler.submit(_request(prompt))  # submitted under the old weights, not yet admitted
    assert scheduler.tokens_so_far(handle)[0].token_ids == []
    engine.update_weights(new_weights_dir, weight_version="step-1")
    scheduler.weights_changed()
    finished = []
    while not finished:
        finished = scheduler.step()
    [choice] = finished[0].result.choices
    assert choice.weight_versions == [{"version": "step-1", "start": 0, "end": TOKENS}]
    assert choice.kv_recomputed is None
    assert choice.logprobs == pytest.approx(teacher_forced(new, prompt, choice.token_ids), abs=ATOL)
