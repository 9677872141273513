"""What a weight update costs a rollout in mode ``keep`` against mode ``finish`` (issue #51).

The bench-sized Qwen2-VL of ``bench/rollout.py``, one process, one torch thread, the scheduler
driven as the GPU session drives it (workers/gpu/session.py): a stream of requests (one text
prompt, temperature 1, lengths spread over 8-96 tokens: a GRPO step's long tail) joins a batch of
``ROWS`` rows, and every ``EVERY`` decode steps a weight update lands (a real swap, alternating
two checkpoints). ``finish`` stops taking requests, lets the running rows end, then swaps;
``keep`` swaps between two steps and the rows go on (``Scheduler.weights_changed``), with and
without ``recompute_kv``. Useful tokens per second over the whole stream, and the seconds each
update cost against the same stream with none (a finish drain stretches the stream, so it sees
fewer updates: the cost per update is the comparable figure); the swap itself costs every mode the
same.

Run: ``python -m bench.update_modes`` from the repository root.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.rows import print_rows  # noqa: E402

PROMPT = "User: describe a long walk along the sea on a windy day, in many words. Assistant:"
REQUESTS, ROWS, EVERY = 96, 16, 24
MODES = (("no updates", {}), ("finish", {}), ("keep", {"recompute_kv": False}),
         ("keep, recompute_kv", {"recompute_kv": True}))


def run_stream(engine, prompt: list[int], checkpoints: list[Path], mode: str, knobs: dict) -> tuple[float, int, int]:
    """Seconds, tokens and updates of one stream of REQUESTS under ``mode``."""
    from dataclasses import replace

    from engine.generation import GenerationRequest
    from engine.sampling_params import SamplingParams

    lengths = random.Random(0).choices(range(8, 97), k=REQUESTS)
    waiting = [GenerationRequest(prompt, SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True))
               for i, n in enumerate(lengths)]
    sched = engine.scheduler(limits=replace(engine.limits, max_rows=ROWS))
    tokens = updates = steps = 0
    draining = False
    started = time.perf_counter()
    while waiting or sched.has_work:
        while waiting and not draining and sched.free_rows > 0:
            sched.submit(waiting.pop(0))
        for finished in sched.step():
            tokens += sum(len(c.token_ids) for c in finished.result.choices)
        steps += 1
        if steps % EVERY == 0 and mode != "no updates":
            draining = True
        if draining and (mode == "keep" or not sched.has_work):
            engine.update_weights(checkpoints[updates % 2], weight_version=f"v{updates}")
            updates += 1
            if sched.has_work:
                sched.weights_changed(**knobs)
            draining = False
    sched.close()
    return time.perf_counter() - started, tokens, updates


def run() -> list[dict]:
    from transformers import AutoTokenizer

    from bench.rollout import build_bench_model
    from engine.generation import Engine
    from engine.loading import load_model

    torch.set_num_threads(1)
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_bench_model(Path(tmp) / "bench-qwen2-vl")
        engine = Engine(load_model(str(directory), device="cpu"))
        with torch.no_grad():  # a second checkpoint: the trainer's next step
            for p in engine.loaded.model.parameters():
                p.mul_(1.01)
        engine.save_weights(Path(tmp) / "step-b")
        checkpoints = [Path(tmp) / "step-b", directory]
        prompt = AutoTokenizer.from_pretrained(directory)(PROMPT, add_special_tokens=False)["input_ids"]
        run_stream(engine, prompt, checkpoints, "no updates", {})  # warm up
        results: dict[str, tuple[float, int, int]] = {}
        for _ in range(2):  # alternating; the fastest of each counts
            for name, knobs in MODES:
                run = run_stream(engine, prompt, checkpoints, name.split(",")[0], knobs)
                results[name] = min(results.get(name, run), run)
        swap = time.perf_counter()
        engine.update_weights(checkpoints[0], weight_version="timing")
        swap = time.perf_counter() - swap
        base = results["no updates"][0]
        for name, (seconds, tokens, updates) in results.items():
            rows_out.append({"name": f"useful tok/s, {REQUESTS} requests over {ROWS} rows, an update every "
                                     f"{EVERY} steps ({updates} updates), {name}",
                             "value": round(tokens / seconds, 1), "goal": None})
            if updates:
                rows_out.append({"name": f"· s lost per update, {name}", "value": round((seconds - base) / updates, 3),
                                 "goal": "about one swap" if name == "keep" else None})
        rows_out.append({"name": "· one swap, s", "value": round(swap, 3), "goal": None})
    return rows_out


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
