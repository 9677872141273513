"""GRPO groups on a fleet of GPU workers, with prefix affinity and without (issue #48's second workload).

slime and AReaL send each of a prompt's G samples as a request of its own. A real stack (embedded
Redis, one CPU worker and 1, 2 or 4 GPU workers as subprocesses on the demo model, the API in this
process) takes 32 prompts x 8 samples, each prompt a question with one 224x224 image of its own,
submitted in one bulk in random order (8 sampled tokens each). Per fleet, with
``ROLLOUT_GPU_AFFINITY`` on (the default) and off:

- the share of prompt tokens computed: the GPU workers' ``engine_prefill_tokens`` over the prompt
  tokens asked (ideal: 1/8, each prompt once);
- vision-encoder calls per distinct image (ideal: 1);
- the most jobs one GPU worker ran over the fewest (from each result's ``nodes.generate_worker``).

Goal (issue #48): with 4 workers, the share within 1.15 x the one-worker figure and each worker's
load within 2x of the others'.

    python -m bench.grpo_fleet [--workers 1 2 4] [--prompts 32] [--samples 8]
"""

from __future__ import annotations

import argparse
import base64
import io
import random
import tempfile
from collections import Counter
from pathlib import Path

from PIL import Image

from bench.rows import print_rows
from bench.stack import Service
from engine.demo_model import build_demo_model


def image_url(i: int) -> str:
    rng = random.Random(i)
    image = Image.new("RGB", (224, 224), (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    for _ in range(20):  # a few blocks of colour: each prompt's image its own
        x, y = rng.randrange(200), rng.randrange(200)
        image.paste((rng.randrange(256), rng.randrange(256), rng.randrange(256)), (x, y, x + 24, y + 24))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def workload(prompts: int, samples: int) -> list[dict]:
    bodies = []
    for p in range(prompts):
        url = image_url(p)
        for s in range(samples):
            bodies.append({"prompt": f"<image>Problem {p}: what is in the picture, and why? Think step by step.",
                           "content_parts": [{"type": "image_url", "url": url}],
                           "sampling_params": {"max_tokens": 8, "temperature": 1.0, "seed": p * 1000 + s}})
    random.Random(0).shuffle(bodies)
    return bodies


def run_fleet(model_dir: Path, gpus: int, affinity: bool, bodies: list[dict], images: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as state:
        service = Service(Path(state), model_dir, batch=None, workers=("cpu", *["gpu"] * gpus), gpu_affinity=affinity)
        try:
            service.start_workers()
            service.wait_ready(timeout=300)
            ids = []
            for start in range(0, len(bodies), 64):
                ids += service.submit_many(bodies[start:start + 64])
            jobs = service.lookup_ended(ids)
            assert all(job["status"] == "succeeded" for job in jobs), [j for j in jobs if j["status"] != "succeeded"][:1]
            service.close_workers()  # each session writes its last counters as it ends
            counters = {k.decode(): int(v) for k, v in service.svc.redis.hgetall("rq:metrics:counters").items()}
        finally:
            service.close()
    asked = sum(len(job["result"]["prompt_token_ids"]) for job in jobs)
    per_worker = Counter(job["result"]["nodes"]["generate_worker"] for job in jobs)
    loads = [per_worker.get(name, 0) for name in per_worker] + [0] * (gpus - len(per_worker))
    return {"share": counters.get("engine_prefill_tokens", 0) / asked,
            "encoder": counters.get("engine_encoder_calls", 0) / images,
            "imbalance": max(loads) / max(1, min(loads))}


def run(workers: tuple[int, ...] = (1, 2, 4), prompts: int = 32, samples: int = 8) -> list[dict]:
    """The rows of bench/README.md: per fleet, affinity on and off, the share computed, encoder
    calls per image and the spread of jobs; with more workers, the share against one worker's."""
    bodies = workload(prompts, samples)
    rows, one_worker = [], None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "model")
        for gpus in workers:
            for affinity in ((True,) if gpus == 1 else (True, False)):
                figures = run_fleet(model_dir, gpus, affinity, bodies, prompts)
                if gpus == 1:
                    one_worker = figures["share"]
                label = f"GRPO {prompts}x{samples}, {gpus} GPU worker{'s' if gpus > 1 else ''}"
                label += "" if gpus == 1 else f", affinity {'on' if affinity else 'off'}"
                rows += [{"name": f"{label}: share of prompt tokens computed (ideal {1 / samples:.3f})",
                          "value": round(figures["share"], 3), "goal": ""},
                         {"name": f"{label}: encoder calls per distinct image",
                          "value": round(figures["encoder"], 2), "goal": "<= 1.05" if affinity else ""},
                         {"name": f"{label}: most / fewest jobs of one worker",
                          "value": round(figures["imbalance"], 2), "goal": "<= 2" if gpus > 1 and affinity else ""}]
                if gpus > 1 and one_worker:
                    rows.append({"name": f"{label}: share computed / one worker's",
                                 "value": round(figures["share"] / one_worker, 2),
                                 "goal": "<= 1.15" if affinity else ""})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    print_rows(run(tuple(args.workers), args.prompts, args.samples))


if __name__ == "__main__":
    main()
