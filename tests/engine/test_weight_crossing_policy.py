"""A weight swap between two steps, update mode keep (engine/weight_crossing.py), on the table
runner of tests/engine/test_scheduler_policy.py: what the policy does with each request's state
(running rows, a prompt part way through its chunks, the names of its blocks). That a kept row's
numbers are the new weights' forward is tested on the demo model (test_keep_across_update.py)."""

from __future__ import annotations

from tests.engine.test_scheduler_policy import TableFacts, request, run_to_end, scheduler


def _swap(sched, version: str = "v2") -> None:
    """What Engine.update_weights does to a scheduler's world: the facts' version, no names kept."""
    sched.facts.weight_version = version
    sched.pool.forget_names()
    sched.prefixes.prompt_ends.clear()


def _steps(sched, count: int) -> None:
    for _ in range(count):
        assert sched.step() == []


def test_a_kept_row_goes_on_and_its_spans_split_where_the_swap_landed():
    sched = scheduler(facts=TableFacts())
    sched.submit(request([1, 2, 3], max_tokens=8), tag="a")
    _steps(sched, 3)  # the prefill's token and two decoded: three tokens
    _swap(sched)
    sched.weights_changed()
    choice = run_to_end(sched)["a"].result.choices[0]
    assert choice.token_ids == list(range(4, 12)) and choice.kv_recomputed is False
    assert choice.weight_versions == [{"version": "v1", "start": 0, "end": 3}, {"version": "v2", "start": 3, "end": 8}]
    assert sched.pool.in_use == 0


def test_recompute_kv_prefills_each_prompt_once_then_each_kept_rows_tokens_after_its_shared_blocks():
    sched = scheduler()
    sched.submit(request(range(9), max_tokens=8, n=2), tag="a")
    _steps(sched, 3)
    held = sched.pool.in_use
    sched.runner.calls.clear()
    _swap(sched)
    sched.weights_changed(recompute_kv=True)
    # The prompt (9), then each row's prompt + the two tokens in its cache (the third is fed next)
    # after the prompt's two full blocks of 4, which both rows share again.
    assert sched.runner.calls == [("prefill", [(9, 0)]), ("prefill", [(11, 8), (11, 8)])]
    assert sched.pool.in_use == held
    result = run_to_end(sched)["a"].result
    assert [c.kv_recomputed for c in result.choices] == [True, True]
    assert all(c.token_ids == list(range(9, 17)) for c in result.choices)
    assert sched.pool.in_use == 0


def test_a_kept_row_names_none_of_its_blocks_and_no_old_block_is_found_after_the_swap():
    prompt = list(range(12))
    control = scheduler()
    control.submit(request(prompt, max_tokens=9))
    tokens = run_to_end(control)[None].result.choices[0].token_ids
    control.submit(request([*prompt, *tokens], max_tokens=1), tag="turn")
    assert run_to_end(control)["turn"].result.cached_tokens == 20  # a finished row's blocks are found

    for recompute in (False, True):
        sched = scheduler()
        sched.submit(request(prompt, max_tokens=9))
        _steps(sched, 2)
        _swap(sched)
        sched.weights_changed(recompute_kv=recompute)
        run_to_end(sched)
        sched.submit(request([*prompt, *tokens], max_tokens=1), tag="turn")
        # Without recompute nothing is found; recomputed blocks are the new weights' own, yet their
        # prompt blocks are unnamed: the chain from the prompt's first block is not found either.
        assert run_to_end(sched)["turn"].result.cached_tokens == 0, recompute


def test_a_prompt_part_way_through_its_chunks_starts_again_on_the_new_weights():
    sched = scheduler(prefill_chunk_tokens=8)
    sched.submit(request([5] * 4, max_tokens=10), tag="decoding")
    sched.step()
    sched.submit(request(range(20), max_tokens=2), tag="long")
    sched.step()
    sched.runner.calls.clear()
    _swap(sched)
    sched.weights_changed()
    results = run_to_end(sched)
    assert [c for c in sched.runner.calls if c[0] == "chunk"] == [("chunk", 8), ("chunk", 16), ("chunk", 20)]
    long = results["long"].result.choices[0]
    assert long.weight_versions == [{"version": "v2", "start": 0, "end": 2}] and long.kv_recomputed is None
    assert results["long"].result.weight_version == "v2" and sched.pool.in_use == 0


def test_max_policy_lag_ends_rows_at_the_update_they_may_not_cross():
    sched = scheduler()
    params = request([1, 2, 3], max_tokens=20)
    bounded = [params.__class__(params.prompt_token_ids, params.sampling.__class__(
        max_tokens=20, temperature=0, ignore_eos=True, max_policy_lag=lag)) for lag in (0, 1)]
    sched.submit(bounded[0], tag="lag0")
    sched.submit(bounded[1], tag="lag1")
    _steps(sched, 2)
    _swap(sched, "v2")
    sched.weights_changed()
    results = {f.tag: f for _ in range(2) for f in sched.step()}  # lag0 ends at the first of them
    assert list(results) == ["lag0"]
    _swap(sched, "v3")
    sched.weights_changed()
    results |= run_to_end(sched)
    lag0, lag1 = results["lag0"].result, results["lag1"].result
    assert lag0.choices[0].finish_reason == "policy_lag" and len(lag0.choices[0].token_ids) == 2
    assert lag0.weight_version == "v1" and lag0.choices[0].weight_versions == [{"version": "v1", "start": 0, "end": 2}]
    assert lag1.choices[0].finish_reason == "policy_lag" and len(lag1.choices[0].token_ids) == 4
    assert lag1.choices[0].weight_versions == [{"version": "v1", "start": 0, "end": 2},
                                               {"version": "v2", "start": 2, "end": 4}]
    assert lag1.weight_version == "v2" and sched.pool.in_use == 0
