"""What one key's jobs cost another key's in the GPU batch (issue #56 item 3): the engine's scheduler
at its defaults, stepped in this process on the demo model (one CPU thread, as the workers run), with
wall-clock arrivals. A GPU worker's session adds Redis round trips, not decisions.

- Livelock: key A fills the 128 rows with two n=64 jobs of 200 tokens (1-2 CPU seconds alone here;
  the issue's took 5.5 s); key B sends one 2-token job every 1/5.5 of that (the issue's one a second). A's
  end-to-end time with the trickle and without it, the median of three each (goal <= 1.5x): each of B's jobs used to preempt
  A's newest job, which ran again from its prompt and never ended while B sent. Counted in this
  process's CPU seconds (B's arrivals too), as the machine is shared; wall-clock pairs beside.
- Ties: ``ROLLOUT_GPU_BATCH_SIZE=32``, ``ROLLOUT_KV_CACHE_TOKENS=16384``: key A's bulk of jobs of
  n=32 x 480 tokens (each the whole batch), then key B's 8-token job. How many of A's jobs end
  before B's (goal <= 1: B goes when A's running job ends), and B's time, by recent use (the
  rule now) and by rows held at that instant (the old rule: ``usage_half_life_s=0``).

    python -m bench.tenant_scheduling   (or with the rest: python -m bench.tenant_load)
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.capacity import SchedulerLimits
from engine.generation import Engine, GenerationRequest
from engine.sampling_params import SamplingParams

LIVELOCK_TOKENS = 200
RUNS = 3  # alone, then with the trickle: each figure the median
TIE_JOBS = 3  # A's bulk (the was 40: B's place among them is decided at the first end)


def _request(prompt: list[int], max_tokens: int, n: int, tenant: str) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, n=n, ignore_eos=True),
                             tenant=tenant)


def livelock(engine: Engine, every: float | None, clock=time.process_time) -> tuple[float, list[float], int]:
    """A's two n=64 jobs until both end (seconds), with B's 2-token job every ``every`` s or not; B's
    jobs' end-to-end times, and the preemptions. Seconds of ``clock``: this process's CPU time by
    default (the engine's one thread), which another process's load on a shared machine leaves alone."""
    sched = engine.scheduler()
    before = engine.stats.preempted_requests
    for i in range(2):
        sched.submit(_request([100 + i] * 8, LIVELOCK_TOKENS, 64, "a"), tag=f"a{i}")
    started = clock()
    next_b, arrived, b_times, a_left = started + (every or 0), {}, [], {"a0", "a1"}
    a_took = 0.0
    while sched.has_work:
        now = clock()
        if every and a_left and now >= next_b:
            tag = f"b{len(arrived)}"
            arrived[tag] = now
            sched.submit(_request([200 + len(arrived)] * 8, 2, 1, "b"), tag=tag)
            next_b += every
        for finished in sched.step():
            assert finished.error is None, finished.error
            if finished.tag in arrived:
                b_times.append(clock() - arrived[finished.tag])
            a_left.discard(finished.tag)
            if not a_left and not a_took:
                a_took = clock() - started
    return a_took, b_times, engine.stats.preempted_requests - before


def ties(engine: Engine) -> tuple[int, float, float]:
    """A's bulk of whole-batch jobs, B's 8-token job once A's first runs: how many of A's jobs ended
    before B's, B's end-to-end seconds, and A's seconds per job."""
    sched = engine.scheduler()
    for i in range(TIE_JOBS):
        sched.submit(_request([100 + i] * 16, 480, 32, "a"), tag=f"a{i}")
    started = time.perf_counter()
    for _ in range(10):
        sched.step()
    b_at = time.perf_counter()
    sched.submit(_request([300] * 16, 8, 1, "b"), tag="b")
    a_before, b_took = 0, 0.0
    while sched.has_work:
        for finished in sched.step():
            if finished.tag == "b":
                b_took = time.perf_counter() - b_at
            else:
                a_before += not b_took
    return a_before, b_took, (time.perf_counter() - started) / TIE_JOBS


def run() -> list[dict]:
    from engine.demo_model import build_demo_model
    from engine.loading import load_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(str(build_demo_model(Path(tmp) / "model")), device="cpu")
    livelock(Engine(loaded, SchedulerLimits()), None)  # warm up (the first forwards)
    # B's period is A's time alone over 5.5, the proportion (1 s against 5.5 s) on any machine.
    alone = statistics.median(livelock(Engine(loaded, SchedulerLimits()), None)[0] for _ in range(RUNS))
    every = alone / 5.5
    trickled_runs = [livelock(Engine(loaded, SchedulerLimits()), every) for _ in range(RUNS)]
    trickled = statistics.median(run[0] for run in trickled_runs)
    b_times = [b for run in trickled_runs for b in run[1]]
    preempted = sum(run[2] for run in trickled_runs)
    walls = []  # wall-clock pairs, B's period from the pair's own run alone
    for _ in range(RUNS):
        wall_alone = livelock(Engine(loaded, SchedulerLimits()), None, clock=time.perf_counter)[0]
        wall_trickled = livelock(Engine(loaded, SchedulerLimits()), wall_alone / 5.5, clock=time.perf_counter)[0]
        walls.append(wall_trickled / wall_alone)
    tie = SchedulerLimits(max_rows=32, kv_cache_tokens=16384)
    a_before, b_took, a_job = ties(Engine(loaded, tie))
    old_before, old_b_took, _ = ties(Engine(loaded, SchedulerLimits(max_rows=32, kv_cache_tokens=16384,
                                                                    usage_half_life_s=0)))
    name = f"two n=64 x {LIVELOCK_TOKENS}-token jobs of key A in 128 rows"
    return [
        {"name": f"livelock: {name}, alone, median (s)", "value": round(alone, 2), "goal": None},
        {"name": f"livelock: {name}, key B's 2-token job every {every:.2f} s, median (s)", "value": round(trickled, 2),
         "goal": None},
        {"name": "livelock: key A's time with the trickle / alone", "value": round(trickled / alone, 2),
         "goal": "<= 1.5"},
        {"name": "livelock: the same in wall-clock seconds, median of pairs", "value": round(statistics.median(walls), 2),
         "goal": None},
        {"name": f"livelock: key B's jobs sent / preemptions, {RUNS} runs", "value": f"{len(b_times)} / {preempted}",
         "goal": None},
        {"name": "livelock: key B's job end-to-end, max (s)", "value": round(max(b_times, default=0.0), 3),
         "goal": None},
        {"name": "ties: key A's n=32 x 480-token job (the whole batch of 32), each (s)", "value": round(a_job, 2),
         "goal": None},
        {"name": "ties: key A's jobs ending before key B's 8-token job, by recent use", "value": a_before,
         "goal": "<= 1"},
        {"name": "ties: key B's 8-token job end-to-end, by recent use (s)", "value": round(b_took, 2), "goal": None},
        {"name": "ties: the same, by rows held at that instant (the old rule): A's jobs before B's",
         "value": old_before, "goal": None},
        {"name": "ties: the same, by rows held at that instant: key B's job end-to-end (s)",
         "value": round(old_b_took, 2), "goal": None},
    ]


def main() -> None:
    from bench.rows import print_rows

    print_rows(run())


if __name__ == "__main__":
    main()
