"""The engine against transformers' own batched ``generate`` on uniform batches (issue #28).

Same model (the bench-sized Qwen2-VL of ``bench/rollout.py``: a decode step is compute, not
Python), same rows, one process, one torch thread: every row has the same text prompt and runs
to ``max_tokens`` (``ignore_eos`` here, ``min_new_tokens`` there). Two workloads: 32 rows x 128
tokens sampled at temperature 1 / top_p 0.95 (transformers' default top_k of 50 turned off, as
the engine has none), and 8 rows x 1,024 tokens greedy. Each side runs twice, alternating, and
the faster run counts. Goal: engine / transformers >= 1.0 on both.

Run: ``python -m bench.uniform_batches`` from the repository root.
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
WORKLOADS = (  # name, rows, new tokens, sampling
    ("32 rows x 128 tokens, temperature 1 / top_p 0.95", 32, 128, {"temperature": 1.0, "top_p": 0.95}),
    ("8 rows x 1,024 tokens, greedy", 8, 1024, {"temperature": 0.0}),
)


def engine_seconds(engine, prompt: list[int], rows: int, new: int, sampling: dict) -> float:
    from engine.generation import GenerationRequest
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new, ignore_eos=True, logprobs=True, **sampling)
    started = time.perf_counter()
    results = engine.generate([GenerationRequest(prompt, params) for _ in range(rows)])
    elapsed = time.perf_counter() - started
    assert all(len(r.choices[0].token_ids) == new for r in results)
    return elapsed


def transformers_seconds(model, prompt: list[int], rows: int, new: int, sampling: dict) -> float:
    input_ids = torch.tensor([prompt] * rows)
    knobs = ({"do_sample": True, "temperature": sampling["temperature"], "top_p": sampling["top_p"], "top_k": 0}
             if sampling["temperature"] else {"do_sample": False})
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True, **knobs)
    elapsed = time.perf_counter() - started
    assert out.sequences.shape == (rows, len(prompt) + new)
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
        loaded = load_model(str(directory), device="cpu")
        engine, model = Engine(loaded), loaded.model
        prompt = AutoTokenizer.from_pretrained(directory)(PROMPT, add_special_tokens=False)["input_ids"]
        engine_seconds(engine, prompt, 4, 8, {"temperature": 1.0, "top_p": 0.95})  # warm up both sides
        transformers_seconds(model, prompt, 4, 8, {"temperature": 1.0, "top_p": 0.95})
        for name, rows, new, sampling in WORKLOADS:
            ours, theirs = [], []
            for _ in range(2):
                ours.append(engine_seconds(engine, prompt, rows, new, sampling))
                theirs.append(transformers_seconds(model, prompt, rows, new, sampling))
            tokens = rows * new
            rows_out += [
                {"name": f"engine tok/s, {name}", "value": round(tokens / min(ours), 1), "goal": None},
                {"name": f"transformers generate tok/s, {name}", "value": round(tokens / min(theirs), 1), "goal": None},
                {"name": f"engine / transformers generate, {name}", "value": round(min(theirs) / min(ours), 2),
                 "goal": ">= 1.0"},
            ]
    return rows_out


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
