"""Engine benchmarks on the tiny demo model: batched vs one-at-a-time generation, and scoring.

Goal (bench/README.md): "GPU worker throughput, batched / one at a time (16 concurrent jobs)", goal >= 5,
measured here in-process: 16 mixed requests (text and image prompts, greedy and seeded
sampling, 64 new tokens each, ignore_eos so every request does the same work) in one
``Engine.generate`` call vs 16 calls. :func:`score_in_process` is the in-process scoring loop
that the bulk-scoring figure compares the service against.

Run: ``python -m bench.generation_batching`` from the repository root.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a file, bench/ comes first on sys.path and this module would shadow the engine package.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.rows import print_rows  # noqa: E402
from engine.generation import Engine, GenerationRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scoring import ScoreRequest  # noqa: E402

CONCURRENT = 16
NEW_TOKENS = 64
_TEXTS = (
    "Describe the image in one sentence.",
    "The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.",
    "Count the objects in the picture and answer with a number.",
    "Mathematics: if x + 2 = 5 then x = 3.",
    "Yes.",
    "The weather today is sunny with a light breeze from the west, and the sea is calm.",
    "Code: def f(x): return x * 2; print(f(21)) prints 42.",
    "User: what is in this photo? Assistant:",
)


class Workload:
    """Prompts for the demo model: token ids from its tokenizer, image features from its processor."""

    def __init__(self, engine: Engine, model_dir: Path):
        from PIL import Image
        from transformers import AutoImageProcessor, AutoTokenizer

        self.engine = engine
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        processor = AutoImageProcessor.from_pretrained(model_dir)
        out = processor(images=[Image.new("RGB", (64, 48), "red")], return_tensors="pt")
        self.image = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        config = engine.loaded.model.config
        n = int(self.image["image_grid_thw"].prod()) // config.vision_config.spatial_merge_size**2
        self.image_tokens = [config.vision_start_token_id, *[config.image_token_id] * n, config.vision_end_token_id]

    def text(self, i: int) -> list[int]:
        return self.tokenizer(_TEXTS[i % len(_TEXTS)], add_special_tokens=False)["input_ids"]

    def generation_requests(self, count: int = CONCURRENT, new_tokens: int = NEW_TOKENS) -> list[GenerationRequest]:
        requests = []
        for i in range(count):
            if i % 2:
                sampling = SamplingParams(max_tokens=new_tokens, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
            else:
                sampling = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
            if i % 4 == 0:
                requests.append(GenerationRequest(self.image_tokens + self.text(i), sampling, mm_kwargs=self.image))
            else:
                requests.append(GenerationRequest(self.text(i), sampling))
        return requests

    def score_requests(self, count: int, completion_tokens: int = NEW_TOKENS) -> list[ScoreRequest]:
        completion = (self.text(1) * completion_tokens)[:completion_tokens]
        return [
            ScoreRequest(self.image_tokens + self.text(i), completion, mm_kwargs=self.image)
            if i % 4 == 0 else ScoreRequest(self.text(i), completion)
            for i in range(count)
        ]


def generation_throughput(engine: Engine, requests: Sequence[GenerationRequest], *, batched: bool) -> float:
    """Completion tokens per second: all requests in one call, or one call per request."""
    started = time.perf_counter()
    results = engine.generate(requests) if batched else [engine.generate([r])[0] for r in requests]
    elapsed = time.perf_counter() - started
    return sum(r.usage["completion_tokens"] for r in results) / elapsed


def score_in_process(engine: Engine, requests: Sequence[ScoreRequest], *, batch_size: int = 16) -> dict[str, float]:
    """The in-process scoring loop: ``requests`` scored in batches of ``batch_size``, in order.

    The baseline a bulk-scoring service run over the same rows is compared with (goal >= 0.8).
    """
    started = time.perf_counter()
    tokens = 0
    for i in range(0, len(requests), batch_size):
        for result in engine.score(requests[i : i + batch_size]):
            tokens += len(result.logprobs)
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "rows_per_s": len(requests) / elapsed, "tokens_per_s": tokens / elapsed}


def run(model_dir: Path | None = None) -> list[dict]:
    """The engine rows of the benchmark table: ``{name, value, goal}`` (goal None: reported only)."""
    from engine.demo_model import build_demo_model
    from engine.loading import load_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir or build_demo_model(Path(tmp) / "demo-qwen2-vl")
        engine = Engine(load_model(str(directory), device="auto"))
        work = Workload(engine, directory)
        requests = work.generation_requests()
        engine.generate(work.generation_requests(count=4, new_tokens=4))  # warm up
        batched = generation_throughput(engine, requests, batched=True)
        single = generation_throughput(engine, requests, batched=False)
        score_rows = work.score_requests(64)
        score_in_process(engine, score_rows[:4], batch_size=4)  # warm up
        scoring = score_in_process(engine, score_rows, batch_size=16)
        scoring_single = score_in_process(engine, score_rows, batch_size=1)
    device = engine.loaded.device.type
    return [
        {"name": f"engine generate tok/s, 16 in one batch ({device})", "value": round(batched, 1), "goal": None},
        {"name": f"engine generate tok/s, one at a time ({device})", "value": round(single, 1), "goal": None},
        {"name": "GPU worker throughput, batched / one at a time (16 concurrent jobs, in-process)",
         "value": round(batched / single, 2), "goal": ">= 5"},
        {"name": "engine score rows/s, in-process loop, batches of 16", "value": round(scoring["rows_per_s"], 1),
         "goal": None},
        {"name": "engine score, batches of 16 / one at a time", "value":
            round(scoring["rows_per_s"] / scoring_single["rows_per_s"], 2), "goal": None},
    ]


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
