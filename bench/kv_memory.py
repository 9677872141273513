"""KV memory on a long-tailed workload (issue #28): what the paged cache holds against what its
rows attend to, and how many rows decode together under one KV budget.

Jobs: prompts of ~100 tokens (each its own), ``max_tokens`` long-tailed (80 % from 16 to 192,
20 % from 512 to 2,048; seeded), ``ignore_eos`` so every row runs to its end; the tiny demo model
in one process.

- **Held / live**: 64 jobs through 16 rows (rows join as others leave, so their lengths differ),
  summed over every decode step: the KV pool's blocks in use (in tokens) over the tokens the rows
  attend to (goal <= 1.1). Beside it, on the same steps, what a left-padded cache holds: rows x
  the longest live row (the engine's cache before blocks).
- **Rows decoding together** while jobs wait, 256 jobs under a budget of 16,384 KV tokens: the
  paged engine's mean rows per decode step, measured, against the admission rule of the
  left-padded cache (rows x width at its worst point within the budget), simulated on the same
  jobs. The paged rule is simulated too, to show the simulation agrees with the measured run.

Run: ``python -m bench.kv_memory`` from the repository root.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.rows import print_rows  # noqa: E402
from engine.capacity import RowFuture, SchedulerLimits, peak_blocks  # noqa: E402
from engine.generation import Engine, GenerationRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

PROMPT_TOKENS = 100
BUDGET_TOKENS = 16_384
BLOCK = 16


def long_tail(jobs: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(512, 2048) if rng.random() < 0.2 else rng.randint(16, 192) for _ in range(jobs)]


def requests(engine: Engine, lengths: list[int]) -> list[GenerationRequest]:
    rng = random.Random(1)
    media = set(engine.loaded.media_token_ids.values())
    vocab = [t for t in range(engine.loaded.vocab_size) if t not in media and t not in engine.loaded.eos_token_ids]
    return [GenerationRequest([rng.choice(vocab) for _ in range(PROMPT_TOKENS + rng.randint(-8, 8))],
                              SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for n in lengths]


def left_padded_peak(rows: list[tuple[int, int]]) -> int:
    """The most rows x width a left-padded cache reaches for rows (length now, steps left)."""
    peak = 0
    for _, steps in rows:
        alive = [(length, left) for length, left in rows if left >= steps]
        peak = max(peak, len(alive) * max(length + steps for length, _ in alive))
    return peak


def simulate_rows(jobs: list[tuple[int, int]], fits) -> float:
    """Mean rows per decode step while jobs wait, FCFS admission under ``fits(rows)``, for jobs
    (prompt, max_tokens) each of one row."""
    pending, running, steps, rows = list(jobs), [], 0, 0
    while pending:
        while pending and fits([*running, pending[0]]):
            running.append(pending.pop(0))
        steps += 1
        rows += len(running)
        running = [(length + 1, left - 1) for length, left in running if left > 1]
    return rows / steps


def rows_while_waiting(engine: Engine, work: list[GenerationRequest]) -> float:
    """Mean rows per decode step while requests wait, measured on the engine's scheduler."""
    scheduler = engine.scheduler()
    for request in work:
        scheduler.submit(request)
    steps = rows = 0
    while scheduler.has_work:
        scheduler.step()
        if scheduler.waiting:
            steps += 1
            rows += scheduler.running_rows
    return rows / steps


def run(model_dir: Path | None = None) -> list[dict]:
    from engine.demo_model import build_demo_model
    from engine.loading import load_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir or build_demo_model(Path(tmp) / "demo-qwen2-vl")
        loaded = load_model(str(directory), device="cpu")
        through_16 = Engine(loaded, SchedulerLimits(max_rows=16, kv_cache_tokens=2**20, kv_block_tokens=BLOCK,
                                                    prompt_cache_tokens=0))
        rows_while_waiting(through_16, requests(through_16, long_tail(64)))  # its own limits (generate lifts max_rows)
        stats = through_16.stats
        held, padded = stats.kv_held_tokens / stats.kv_live_tokens, stats.kv_read_tokens / stats.kv_live_tokens
        tight = Engine(loaded, SchedulerLimits(max_rows=256, kv_cache_tokens=BUDGET_TOKENS, kv_block_tokens=BLOCK,
                                               prompt_cache_tokens=0))
        work = requests(tight, long_tail(256))
        measured = rows_while_waiting(tight, work)
    jobs = [(len(r.prompt_token_ids), r.sampling.max_tokens) for r in work]
    simulated_left = simulate_rows(jobs, lambda rows: left_padded_peak(rows) <= BUDGET_TOKENS)
    simulated_paged = simulate_rows(
        jobs, lambda rows: peak_blocks([RowFuture(p, n, i) for i, (p, n) in enumerate(rows)], BLOCK)
        <= BUDGET_TOKENS // BLOCK)
    budget = f"{BUDGET_TOKENS:,} KV tokens, 256 jobs, while jobs wait"
    return [
        {"name": "KV held / live tokens, paged, 64 long-tailed jobs through 16 rows", "value": round(held, 3),
         "goal": "<= 1.1"},
        {"name": "KV a left-padded cache holds / live tokens, same steps", "value": round(padded, 3), "goal": None},
        {"name": f"rows decoding together, paged, {budget} (measured)", "value": round(measured, 1), "goal": None},
        {"name": f"rows decoding together, paged, {budget} (admission simulated)", "value": round(simulated_paged, 1),
         "goal": None},
        {"name": f"rows decoding together, left-padded, {budget} (admission simulated)",
         "value": round(simulated_left, 1), "goal": None},
        {"name": "rows decoding together, paged / left-padded (simulated)",
         "value": round(simulated_paged / simulated_left, 2), "goal": None},
    ]


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
