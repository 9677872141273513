"""What asking for sampling masks and processed logprobs costs a decode (issue #51 item 4).

The bench-sized Qwen2-VL of ``bench/rollout.py``, one process, one torch thread: 32 rows x 64
tokens of one text prompt (``ignore_eos``), at temperature 1 / top_p 0.95 and at top_k 50, each
run with neither, with ``sampling_mask`` and with both ``sampling_mask`` and ``logprobs_mode``
"processed" (engine/processed_rows.py). Each run three times, alternating, and the fastest
counts. A random model's distribution is near uniform, so top_p 0.95 keeps most of the
vocabulary in every mask: the worst case for the mask's size. Goal: masks on <= 1.10 x off.

Run: ``python -m bench.sampling_mask`` from the repository root.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.rows import print_rows  # noqa: E402

PROMPT = "User: describe a long walk along the sea on a windy day, in many words. Assistant:"
ROWS, NEW = 32, 64
KNOBS = (("temperature 1 / top_p 0.95", {"temperature": 1.0, "top_p": 0.95}),
         ("temperature 1 / top_k 50", {"temperature": 1.0, "top_k": 50}))
ASKS = (("off", {}), ("masks", {"sampling_mask": True}),
        ("masks + processed logprobs", {"sampling_mask": True, "logprobs_mode": "processed"}))


def seconds(engine, prompt: list[int], knobs: dict) -> float:
    from engine.generation import GenerationRequest
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=NEW, ignore_eos=True, **knobs)
    started = time.perf_counter()
    results = engine.generate([GenerationRequest(prompt, params) for _ in range(ROWS)])
    elapsed = time.perf_counter() - started
    assert all(len(r.choices[0].token_ids) == NEW for r in results)
    return elapsed


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
        prompt = AutoTokenizer.from_pretrained(directory)(PROMPT, add_special_tokens=False)["input_ids"]
        seconds(engine, prompt, {"temperature": 1.0, "sampling_mask": True})  # warm up
        for name, knobs in KNOBS:
            times: dict[str, list[float]] = {ask: [] for ask, _ in ASKS}
            for _ in range(3):
                for ask, extra in ASKS:
                    times[ask].append(seconds(engine, prompt, {**knobs, **extra}))
            off = min(times["off"])
            rows_out.append({"name": f"decode tok/s, {ROWS} rows x {NEW}, {name}, masks off",
                             "value": round(ROWS * NEW / off, 1), "goal": None})
            for ask, _ in ASKS[1:]:
                rows_out.append({"name": f"· {ask} on / off, {name}", "value": round(min(times[ask]) / off, 3),
                                 "goal": "<= 1.10"})
    return rows_out


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
