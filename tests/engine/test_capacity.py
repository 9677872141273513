"""Admission under the KV budget (engine/capacity.py): the peak a left-padded cache reaches, and
whether a request may join the running rows now."""

from __future__ import annotations

import random

from engine.capacity import fits_kv_budget, peak_cache_tokens


def test_peak_cache_tokens_matches_a_step_by_step_simulation():
    rng = random.Random(0)
    for _ in range(200):
        rows = [(rng.randint(1, 50), rng.randint(0, 30)) for _ in range(rng.randint(1, 8))]
        simulated = 0
        for t in range(max(left for _, left in rows) + 1):
            alive = [length + t for length, left in rows if left >= t]
            if alive:
                simulated = max(simulated, len(alive) * max(alive))
        assert peak_cache_tokens(rows) == simulated


def test_a_request_joins_only_if_the_peak_with_all_its_rows_stays_within_the_budget():
    running = [(10, 5)]  # one row 10 tokens long with 5 steps left
    # Two rows of a 20-token prompt with 10 new tokens: 3 rows x 25 wide at step 5, then 2 x 30.
    assert peak_cache_tokens([*running, (20, 10), (20, 10)]) == 75
    assert fits_kv_budget(running, [(20, 10, 2)], budget=75)
    assert not fits_kv_budget(running, [(20, 10, 2)], budget=74)
    assert fits_kv_budget([], [], budget=0)
