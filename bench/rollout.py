"""A GRPO-shaped rollout through the service vs a hand-rolled static ``generate`` loop in-process.

Goals (bench/README.md): "GRPO-shaped rollout: service / hand-rolled in-process static generate batches"
(goal >= 2.5), "prefill tokens computed / distinct prompt tokens" (<= 1.1) and "vision-encoder
calls / distinct images" after a second epoch (= 1).

The workload: P prompts, each with its own image, G samples of each submitted as separate jobs
(as slime sends them), long-tailed ``max_tokens`` (most short, a few long), ``ignore_eos`` so every
length is exact, seeded sampling at temperature 1. The model: a random Qwen2-VL built here, larger
than the demo model (so a decode step is compute, not Python) but small enough for 2 cores.

- service: the real stack (``bench.service.Service``: Redis, CPU and GPU workers as subprocesses)
  at its shipped defaults (the GPU batch sized by the KV pool, preprocessing processes by the
  cores), jobs submitted with their images as data URLs, waited for; useful tokens / wall time;
- in-process: what a user writes with transformers alone: the same requests, preprocessed
  beforehand (not timed), in submission order in static batches of 16 through
  ``model.generate(do_sample=True)``, each batch running to its longest row; useful tokens (each
  request's own ``max_tokens``) / wall time.

The engine's counters (``rq:metrics:counters``, reported by the GPU worker) give the prefill tokens
computed, the rows per decode step and the vision-encoder calls.

Run: ``python -m bench.rollout`` from the repository root.
"""

from __future__ import annotations

import base64
import io
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.rows import print_rows

PROMPTS, SAMPLES, BATCH = 8, 8, 16
QUESTIONS = ("Describe the image in one sentence.", "What colour is the square in the picture?",
             "Count the objects in the picture and answer with a number.", "How many cats are on the sofa?")


def build_bench_model(directory: Path) -> Path:
    """A random Qwen2-VL with a 4-layer, 384-wide text model and the demo tokenizer and processor."""
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    from engine.demo_model import build_demo_model

    if (directory / "model.safetensors").exists():
        return directory
    demo = build_demo_model(directory.parent / "demo-for-bench")
    shutil.copytree(demo, directory, dirs_exist_ok=True)
    config = AutoConfig.from_pretrained(demo)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 384, 1024, 4
    text.num_attention_heads, text.num_key_value_heads = 6, 2
    text.layer_types = ["full_attention"] * 4
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [8, 12, 12]}
    config.vision_config.hidden_size = 384  # the merger projects into the text width
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(directory)
    return directory


def max_tokens_for(rng: random.Random) -> int:
    """Long-tailed: 3 in 4 short (8-32), the rest up to 192."""
    return rng.randint(8, 32) if rng.random() < 0.75 else rng.randint(64, 192)


class Workload:
    def __init__(self, model_dir: Path, seed: int = 0):
        from PIL import Image
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        self.ids = {name: config[name] for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
        rng = random.Random(seed)
        self.images, self.pngs = [], []
        for p in range(PROMPTS):
            image = Image.new("RGB", (112 + 28 * (p % 3), 84), (30 * p, 255 - 25 * p, 90))
            buffer = io.BytesIO()
            image.save(buffer, "PNG")
            self.images.append(image)
            self.pngs.append(base64.b64encode(buffer.getvalue()).decode())
        # Group members arrive together, one group after another (a GRPO step).
        self.jobs = [(p, g, max_tokens_for(rng)) for p in range(PROMPTS) for g in range(SAMPLES)]

    def text(self, p: int) -> list[int]:
        return self.tokenizer(QUESTIONS[p % len(QUESTIONS)], add_special_tokens=False)["input_ids"]

    def body(self, p: int, g: int, max_tokens: int) -> dict:
        image = [self.ids["vision_start_token_id"], self.ids["image_token_id"], self.ids["vision_end_token_id"]]
        return {"token_ids": image + self.text(p),
                "content_parts": [{"type": "image_url", "url": f"data:image/png;base64,{self.pngs[p]}",
                                   "uuid": f"bench-image-{p}"}],
                "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": p * 1000 + g,
                                    "ignore_eos": True, "logprobs": True}}

    def model_inputs(self, p: int) -> tuple[list[int], dict]:
        """The expanded prompt and the features, as a user of transformers would build them."""
        out = self.processor(images=[self.images[p]], return_tensors="pt")
        features = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        n = int(out["image_grid_thw"].prod()) // 4
        ids = [self.ids["vision_start_token_id"], *[self.ids["image_token_id"]] * n, self.ids["vision_end_token_id"]]
        return ids + self.text(p), features


def static_loop(model, work: Workload, fill_token_id: int) -> dict:
    """Batches of 16 in submission order through ``model.generate``; useful tokens per second."""
    inputs = [work.model_inputs(p) for p, _, _ in work.jobs]
    started = time.perf_counter()
    useful = computed = 0
    for i in range(0, len(work.jobs), BATCH):
        chunk = list(range(i, min(i + BATCH, len(work.jobs))))
        width = max(len(inputs[j][0]) for j in chunk)
        input_ids = torch.full((len(chunk), width), fill_token_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, j in enumerate(chunk):
            ids = inputs[j][0]
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        features = {k: torch.cat([inputs[j][1][k] for j in chunk]) for k in ("pixel_values", "image_grid_thw")}
        mm_token_type_ids = (input_ids == work.ids["image_token_id"]).int()
        new = max(work.jobs[j][2] for j in chunk)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, mm_token_type_ids=mm_token_type_ids,
                                 **features, do_sample=True, temperature=1.0, max_new_tokens=new,
                                 pad_token_id=fill_token_id)
        assert out.shape[1] == width + new
        useful += sum(work.jobs[j][2] for j in chunk)
        computed += len(chunk) * new
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "tokens_per_s": useful / elapsed, "row_steps_per_token": computed / useful}


def counters(service) -> dict[str, int]:
    raw = service.svc.redis.hgetall("rq:metrics:counters")
    return {k.decode(): int(v) for k, v in raw.items()}


def service_epoch(service, work: Workload) -> dict:
    before = counters(service)
    started = time.perf_counter()
    ids = [service.submit(work.body(p, g, m)) for p, g, m in work.jobs]
    jobs = [service.result(job_id, timeout=600) for job_id in ids]
    elapsed = time.perf_counter() - started
    after = counters(service)
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    for job, (_, _, max_tokens) in zip(jobs, work.jobs, strict=True):
        assert len(job["result"]["choices"][0]["token_ids"]) == max_tokens
    distinct = {tuple(job["result"]["prompt_token_ids"]) for job in jobs}
    return {"seconds": elapsed, "tokens_per_s": sum(m for _, _, m in work.jobs) / elapsed, "counters": delta,
            "distinct_prompt_tokens": sum(len(p) for p in distinct),
            "cached_tokens": sum(job["result"].get("cached_tokens", 0) for job in jobs)}


def run() -> list[dict]:
    from bench.stack import Service
    from engine.loading import load_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rq-rollout-") as tmp:
        state = Path(tmp)
        model_dir = build_bench_model(state / "bench-qwen2-vl")
        work = Workload(model_dir)
        loaded = load_model(str(model_dir), device="cpu")
        warm = Workload(model_dir, seed=1)
        warm.jobs = warm.jobs[:4]
        static_loop(loaded.model, warm, loaded.fill_token_id)  # warm up
        baseline = static_loop(loaded.model, work, loaded.fill_token_id)
        del loaded
        service = Service(state, model_dir, batch=None)  # the shipped defaults: the batch sized by the KV pool
        try:
            service.start_workers()
            service.wait_ready()
            # Warm up on text: no image or prompt of the workload may be cached before it runs.
            service.result(service.submit({"token_ids": [100, 101, 102], "sampling_params": {"max_tokens": 4}}))
            first = service_epoch(service, work)
            second = service_epoch(service, work)
        finally:
            service.close()
    c1, c2 = first["counters"], second["counters"]
    encoder_calls = c1.get("engine_encoder_calls", 0) + c2.get("engine_encoder_calls", 0)
    rows = [
        _row(f"GRPO-shaped rollout ({PROMPTS} prompts x {SAMPLES} samples as jobs, long-tailed max_tokens): "
             "service at its defaults / in-process static generate batches of 16",
             first["tokens_per_s"] / baseline["tokens_per_s"], ">= 2.5"),
        _row("· service, useful tokens/s", first["tokens_per_s"]),
        _row("· in-process static generate loop, useful tokens/s", baseline["tokens_per_s"]),
        _row("· in-process static loop: row-steps computed per useful token", baseline["row_steps_per_token"]),
        _row("· service: mean live rows per decode step",
             c1.get("engine_decode_rows", 0) / max(c1.get("engine_decode_steps", 0), 1)),
        _row("rollout: prefill tokens computed / distinct prompt tokens (1st epoch)",
             c1.get("engine_prefill_tokens", 0) / first["distinct_prompt_tokens"], "<= 1.1"),
        _row("· rollout: cached_tokens reported, 1st epoch (sum over jobs)", first["cached_tokens"]),
        _row("rollout: vision-encoder calls over two epochs / distinct images", encoder_calls / PROMPTS, "<= 1.0"),
        _row("· rollout: 2nd epoch, service useful tokens/s", second["tokens_per_s"]),
    ]
    return rows


def _row(name: str, value: float, goal: str | None = None) -> dict:
    return {"name": name, "value": round(value, 3 if abs(value) < 10 else 1), "goal": goal}


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
