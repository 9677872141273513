"""Admission in KV blocks (engine/capacity.py): the most blocks rows hold at once, and the check
that a request can ever fit the pool."""

from __future__ import annotations

import random

import pytest

from engine.capacity import (
    RowFuture,
    SchedulerLimits,
    check_capacity,
    fits_kv_pool,
    peak_blocks,
    request_peak_blocks,
    request_rows,
)
from engine.errors import CapacityError, Fault


def simulate(rows: list[RowFuture], size: int) -> int:
    """Step by step: every live row's own blocks, plus each live group's shared blocks once."""
    peak = 0
    for t in range(max(r.steps_left for r in rows) + 1):
        alive = [r for r in rows if r.steps_left >= t]
        own = sum(-(-(r.length + t) // size) - r.shared_blocks for r in alive)
        shared = {r.group: r.shared_blocks for r in alive}
        peak = max(peak, own + sum(shared.values()))
    return peak


def test_peak_blocks_matches_a_step_by_step_simulation():
    rng = random.Random(0)
    for _ in range(300):
        size = rng.choice([1, 4, 16])
        rows = []
        for group in range(rng.randint(1, 5)):
            prompt = rng.randint(1, 60)
            rows += [RowFuture(prompt + rng.randint(0, 5), rng.randint(0, 40), group, prompt // size)
                     for _ in range(rng.randint(1, 3))]
        assert peak_blocks(rows, size) == simulate(rows, size)


def test_one_requests_peak_in_closed_form_is_the_simulated_peak():
    rng = random.Random(1)
    for _ in range(300):
        size, prompt, new, n = rng.choice([1, 4, 16]), rng.randint(1, 80), rng.randint(0, 60), rng.randint(1, 6)
        expected = simulate(request_rows(prompt, new, n, "job", size), size)
        assert request_peak_blocks(prompt, new, n, size) == expected


def test_the_samples_of_a_prompt_count_its_full_blocks_once():
    # A 40-token prompt (2 full blocks of 16, 8 tokens over), 4 samples of up to 20 tokens: the 2
    # full blocks once, then each sample's own ceil(60 / 16) - 2 = 2 blocks.
    rows = request_rows(40, 20, 4, "job", 16)
    assert peak_blocks(rows, 16) == 2 + 4 * 2
    assert fits_kv_pool(rows, 10, 16) and not fits_kv_pool(rows, 9, 16)
    # Rows of other requests share nothing: the same rows as four requests hold 4 x 4 blocks.
    assert peak_blocks([RowFuture(40, 20, i, 2) for i in range(4)], 16) == 16


def test_a_request_that_can_never_fit_is_refused_with_what_it_needs():
    limits = SchedulerLimits(max_rows=8, kv_cache_tokens=160, kv_block_tokens=16)  # 10 blocks
    check_capacity(limits, 40, 24, 4)  # 64 tokens a row: 2 shared + 4 x 2 own = 10 blocks
    with pytest.raises(CapacityError) as info:
        check_capacity(limits, 40, 25, 4)  # 65 tokens a row: 2 + 4 x 3 = 14 blocks
    assert info.value.code == "request_exceeds_capacity" and info.value.fault is Fault.INVALID
    assert info.value.errors == {"kv_cache_tokens_needed": 14 * 16, "kv_cache_tokens": 160}
    with pytest.raises(CapacityError):
        check_capacity(limits, 4, 4, 9)  # more rows than the batch has


def test_the_tenant_with_the_least_recent_use_is_admitted_next_first_come_within_a_tenant():
    from engine.capacity import next_admission

    assert next_admission(["a", "a", "b"], {}, {"a": 500.0}) == 2  # b used nothing lately: its job first
    # Issue #56: both hold no rows (a's whole-batch job just ended); the tie no longer goes to a's older job.
    assert next_admission(["a", "a", "b"], {"a": 0, "b": 0}, {"a": 15_360.0, "b": 0.0}) == 2
    assert next_admission(["a", "b"], {"a": 0, "b": 3}, {"a": 40.0, "b": 8.0}) == 1  # recent use first, not rows
    assert next_admission(["a", "a", "b"], {"a": 2, "b": 5}, {}) == 0  # no use either: fewer rows held
    assert next_admission(["a", "b", "c"], {"a": 3, "b": 3, "c": 3}, {}) == 0  # ties: arrival order
    assert next_admission(["a", "a"], {"a": 100}, {"a": 1e9}) == 0  # a key alone takes every row


def test_a_tenant_below_an_even_share_preempts_the_newest_request_of_the_one_above_it():
    from engine.capacity import fair_share_victim

    bulk = [("b", 0.25)] * 4  # b's four requests fill the batch
    assert fair_share_victim("a", 0.01, {"b": 1.0}, bulk, tenants=2) == 3  # b's newest gives way
    assert fair_share_victim("a", 0.01, {"b": 1.0}, bulk, tenants=1) is None  # no one waits: a key alone
    assert fair_share_victim("a", 0.6, {"b": 1.0}, bulk, tenants=2) is None  # a asks past an even share
    assert fair_share_victim("a", 0.01, {"a": 0.5, "b": 0.5}, [("a", 0.5), ("b", 0.5)], tenants=2) is None
    # b's one request is the whole batch: b would drop below its share, so a waits for it to end.
    assert fair_share_victim("a", 0.01, {"b": 1.0}, [("b", 1.0)], tenants=2) is None
    # Three keys: c holds the most, and keeps a third without its newest; b would not.
    shares = {"b": 0.4, "c": 0.6}
    running = [("c", 0.2), ("b", 0.2), ("c", 0.2), ("b", 0.2), ("c", 0.2)]
    assert fair_share_victim("a", 0.1, shares, running, tenants=3) == 4
    # Only a key that used the batch more lately than the waiting one gives way: never a light key to a heavy one.
    assert fair_share_victim("a", 0.01, {"b": 1.0}, bulk, tenants=2, usage={"a": 9.0, "b": 2.0}) is None
    assert fair_share_victim("a", 0.01, {"b": 1.0}, bulk, tenants=2, usage={"a": 2.0, "b": 9.0}) == 3


def test_a_tenants_share_is_its_larger_fraction_of_rows_and_blocks():
    from engine.capacity import dominant_share

    limits = SchedulerLimits(max_rows=8, kv_cache_tokens=160, kv_block_tokens=16)  # 10 blocks
    assert dominant_share(2, 1, limits) == 0.25
    assert dominant_share(1, 5, limits) == 0.5
