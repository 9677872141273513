"""The engine alone, fed as the service feeds it: what arrival alone costs, before any service work.

The end-to-end rows of ``bench/service.py`` compare the service with ``Engine.generate`` handed all
64 jobs at once in batches of 16. The service's GPU worker cannot be handed them so: one client
submitting one ``POST /v1/jobs`` at a time delivers about one job per decode step, so the first
rows start alone, rows join one by one and drift apart, and the last ones decode alone at the end.
This module runs the engine's own scheduler (the one the GPU worker steps) in one process, no
service at all, on the same 64 greedy jobs (32 prompt ids, 32 new tokens, 16 rows), three ways,
alternated round by round, medians of CPU time:

- all at once: every job submitted before the first step (what the in-process baseline does);
- one per step: a job submitted before each step, as single submits arrive;
- fresh prompts, all at once and one per step: the same with prompts the engine's KV cache has
  never seen, so each join needs a prefill forward; one per step twice: with the scheduler's rule
  that joins wait for company (``engine.prefill_plan.hold_joins``) and with it off (each job
  prefilled alone as it arrives).

The ratio "all at once / one per step" is the most the service can reach against that baseline on
this model with single submits, whatever it spends itself.

    python -m bench.arrivals --rounds 9
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.rows import print_rows
from bench.service import _row
from bench.stack import BATCH, NEW_TOKENS, PROMPT_TOKENS, engine_request
from engine.demo_model import build_demo_model
from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams

JOBS = 64


def drive(engine: Engine, requests: list[GenerationRequest], per_step: int, **limits) -> tuple[float, int]:
    """CPU seconds and decode steps for ``requests`` through one scheduler of ``BATCH`` rows,
    ``per_step`` of them submitted before each step (``limits``: SchedulerLimits fields to change)."""
    scheduler = engine.scheduler(limits=replace(engine.limits, max_rows=BATCH, **limits))
    pending, ended, steps = iter(requests), 0, 0
    started = time.thread_time()
    while ended < len(requests):
        for request in itertools.islice(pending, per_step):
            scheduler.submit(request, features=scheduler.check(request))
        ended += len(scheduler.step())
        steps += 1
    scheduler.close()
    return time.thread_time() - started, steps


def fresh_requests(rng: random.Random, vocab: int) -> list[GenerationRequest]:
    """Prompts no cache has seen (ids >= 100: below are the demo model's special and media ids)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [GenerationRequest([rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)], params) for _ in range(JOBS)]


def run(rounds: int = 9) -> list[dict]:
    torch.set_num_threads(1)  # as the workers run
    with tempfile.TemporaryDirectory(prefix="rq-bench-arrivals-") as tmp:
        engine = Engine(load_model(str(build_demo_model(Path(tmp) / "model")), device="cpu"))
    rng = random.Random(0)
    vocab = min(engine.loaded.vocab_size, 600)
    repeated = [engine_request(i) for i in range(JOBS)]  # bench/service.py's jobs: cached after the first round
    drive(engine, repeated, JOBS)  # warm-up
    ways = {"at once": (repeated, JOBS), "one per step": (repeated, 1)}
    fresh = {"fresh, at once": (JOBS, {}), "fresh, one per step": (1, {}),
             "fresh, one per step, each joining at once": (1, {"join_ratio": 0.0})}
    seconds: dict[str, list[float]] = {name: [] for name in (*ways, *fresh)}
    steps: dict[str, int] = {}
    for _ in range(rounds):
        for name, (requests, per_step) in ways.items():
            cpu, steps[name] = drive(engine, requests, per_step)
            seconds[name].append(cpu)
        for name, (per_step, limits) in fresh.items():
            cpu, steps[name] = drive(engine, fresh_requests(rng, vocab), per_step, **limits)
            seconds[name].append(cpu)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return [
        _row(f"engine alone, {JOBS} jobs all at once / one per step, as single submits arrive (median of {rounds})",
             median["at once"] / median["one per step"]),
        *(_row(f"· {name}: CPU ms, decode steps {steps[name]}", median[name] * 1e3) for name in ways),
        _row("engine alone, fresh prompts: all at once / one per step (joins wait for company, hold_joins)",
             median["fresh, at once"] / median["fresh, one per step"]),
        _row("engine alone, fresh prompts: all at once / one per step, each joining at once (join_ratio 0)",
             median["fresh, at once"] / median["fresh, one per step, each joining at once"]),
        *(_row(f"· {name}: CPU ms, decode steps {steps[name]}", median[name] * 1e3) for name in fresh),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    print_rows(run(parser.parse_args().rounds))


if __name__ == "__main__":
    main()
