"""Multi-turn agents on the engine, with prefix reuse and without (issue #48's first workload).

Six agents, six turns each, on the demo model and on ``bench.rollout``'s bench-sized Qwen2-VL (4
layers x 384: a forward is compute, not Python), in one process, one torch thread: turn 1's prompt is
200 fresh tokens; each turn decodes 32 tokens (greedy, ``ignore_eos``), and the next turn's prompt
is the last one, its completion and 48 tokens of a tool's answer, as SkyRL's, verl's and prime-rl's
agent loops send them. The agents' turns run together (one ``Engine.generate`` per turn), the
engine reusing KV blocks across requests (``ROLLOUT_PREFIX_CACHING``, the default) against the same
engine reusing nothing, alternated, medians:

- the share of prompt tokens computed (the engine's ``prefill_tokens`` over the prompt tokens
  asked), against the ideal of each turn computing only what it added (goal: ≤ 1.1 x ideal);
- the rollout's throughput, reuse on / off (CPU time of the whole rollout; useful tokens alike);
- what the lookup costs: the time the rollout spends naming blocks (prompts at submit, rows' decoded
  blocks at their end) and finding them in the pool, over the rollout's time (goal: < 2 %); beside
  it, one 1,000-token prompt's lookup against one decode step of 16 rows.

Both ways give the same greedy tokens, checked.

    python -m bench.prefix_reuse --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.rollout import build_bench_model
from bench.rows import print_rows
from engine import prefix_cache, scheduled_requests
from engine.capacity import SchedulerLimits
from engine.demo_model import build_demo_model
from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.paged_kv import BlockPool
from engine.prefix_hash import prompt_hashes
from engine.sampling_params import SamplingParams

AGENTS, TURNS, FIRST, NEW, TOOL = 6, 6, 200, 32, 48


def rollout(engine: Engine, seed: int) -> tuple[float, int, int, list[list[int]]]:
    """CPU seconds, prompt tokens asked, prompt tokens computed and every turn's tokens, agents together."""
    rng = random.Random(seed)
    vocab = min(engine.loaded.vocab_size, 600)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    prompts = [[rng.randrange(100, vocab) for _ in range(FIRST)] for _ in range(AGENTS)]
    asked, computed, outputs = 0, engine.stats.prefill_tokens, []
    started = time.thread_time()
    for _ in range(TURNS):
        results = engine.generate([GenerationRequest(p, params) for p in prompts])
        asked += sum(map(len, prompts))
        outputs += [r.choices[0].token_ids for r in results]
        prompts = [[*p, *r.choices[0].token_ids, *(rng.randrange(100, vocab) for _ in range(TOOL))]
                   for p, r in zip(prompts, results, strict=True)]
    return time.thread_time() - started, asked, engine.stats.prefill_tokens - computed, outputs


@contextlib.contextmanager
def lookups_timed():
    """Wall seconds spent naming and finding blocks while inside (a list of one float)."""
    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started
        return wrapper

    originals = (scheduled_requests.prompt_hashes, prefix_cache.chain, BlockPool.cached_run)
    scheduled_requests.prompt_hashes, prefix_cache.chain = timed(originals[0]), timed(originals[1])
    BlockPool.cached_run = timed(originals[2])
    try:
        yield spent
    finally:
        scheduled_requests.prompt_hashes, prefix_cache.chain, BlockPool.cached_run = originals


def ideal_share() -> float:
    """Each turn computing only what it added: turn 1 its prompt, later turns the completion and the tool's answer."""
    lengths = [FIRST + turn * (NEW + TOOL) for turn in range(TURNS)]
    return (FIRST + (TURNS - 1) * (NEW + TOOL)) / sum(lengths)


def lookup_cost(engine: Engine, tokens: int = 1000, repeats: int = 200) -> float:
    """Seconds to name a ``tokens``-token prompt's blocks and find them all in a pool holding them."""
    size = engine.limits.kv_block_tokens
    pool = BlockPool(tokens // size + 2, size)
    ids = list(range(100, 100 + tokens))
    names = prompt_hashes("key", "v", ids, size, [])
    for block, name in zip(pool.allocate(len(names.full)), names.full, strict=True):
        pool.name(block, name)
    started = time.perf_counter()
    for _ in range(repeats):
        found = pool.cached_run(prompt_hashes("key", "v", ids, size, []).full)
    assert len(found) == len(names.full)
    return (time.perf_counter() - started) / repeats


def decode_step_seconds(engine: Engine, rows: int = 16) -> float:
    """One decode step of ``rows`` rows of ~232 tokens (the engine's stats over a short run)."""
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    requests = [GenerationRequest(list(range(100 + i, 300 + i)), params) for i in range(rows)]
    steps = engine.stats.decode_steps
    started = time.perf_counter()
    engine.generate(requests)
    return (time.perf_counter() - started) / (engine.stats.decode_steps - steps)


def compare(loaded, rounds: int) -> tuple[dict[bool, float], dict[bool, float]]:
    """Median CPU seconds and the share of prompt tokens computed, reuse on and off, alternated."""
    seconds: dict[bool, list[float]] = {True: [], False: []}
    shares: dict[bool, float] = {}
    for round_ in range(rounds):
        outputs = {}
        for reuse in (True, False):
            engine = Engine(loaded, SchedulerLimits(prefix_caching=reuse))
            cpu, asked, computed, outputs[reuse] = rollout(engine, seed=round_)
            seconds[reuse].append(cpu)
            shares[reuse] = computed / asked
        assert outputs[True] == outputs[False], "prefix reuse changed a greedy token"
    return {reuse: statistics.median(values) for reuse, values in seconds.items()}, shares


def run(rounds: int = 3) -> list[dict]:
    torch.set_num_threads(1)  # as the workers run
    with tempfile.TemporaryDirectory(prefix="rq-bench-prefix-") as tmp:
        demo = load_model(str(build_demo_model(Path(tmp) / "demo")), device="cpu")
        bench_sized = load_model(str(build_bench_model(Path(tmp) / "bench")), device="cpu")
    seconds, shares = compare(demo, rounds)
    larger, _ = compare(bench_sized, rounds)
    with lookups_timed() as spent:
        started = time.perf_counter()
        rollout(Engine(demo), seed=rounds)
        lookup_share = spent[0] / (time.perf_counter() - started)
    ideal = ideal_share()
    engine = Engine(demo)
    lookup, step = lookup_cost(engine), decode_step_seconds(engine)
    shape = f"{AGENTS} agents x {TURNS} turns, {FIRST}-token first turn, {NEW} new + {TOOL} tool tokens a turn"
    return [
        {"name": f"multi-turn agents, prompt tokens computed / ideal ({shape})", "value": round(shares[True] / ideal, 3),
         "goal": "<= 1.1"},
        {"name": f"· share of prompt tokens computed: reuse {shares[True]:.3f}, none {shares[False]:.3f}, "
                 f"ideal {ideal:.3f} (a turn's completion was computed while it decoded)",
         "value": round(shares[True], 3), "goal": ""},
        {"name": f"multi-turn agents, rollout throughput reuse on / off, demo model (CPU {seconds[True]:.2f} / "
                 f"{seconds[False]:.2f} s)", "value": round(seconds[False] / seconds[True], 2), "goal": ">= 1.0"},
        {"name": f"· the same on the bench-sized Qwen2-VL (CPU {larger[True]:.2f} / {larger[False]:.2f} s)",
         "value": round(larger[False] / larger[True], 2), "goal": ""},
        {"name": "multi-turn agents, time naming and finding blocks / the rollout's time",
         "value": round(lookup_share, 4), "goal": "< 0.02"},
        {"name": f"· a 1,000-token prompt's lookup / one 16-row decode step ({lookup * 1e6:.0f} / "
                 f"{step * 1e6:.0f} µs)", "value": round(lookup / step, 4), "goal": ""},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    print_rows(run(parser.parse_args().rounds))


if __name__ == "__main__":
    main()
