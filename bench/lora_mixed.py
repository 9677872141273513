"""What mixing LoRA adapters into the batch costs (issue #58's benchmark).

The bench-sized Qwen2-VL of ``bench/rollout.py``, one process: 64 rows decoding ``NEW`` tokens of
one text prompt (``ignore_eos``, greedy), once all on the base and once spread over the base and 4
adapters (rank 16 on every projection of the language model: 13 rows each, the base 12), each three
times, alternating, the fastest counting. Goal: mixed tokens/s >= 0.8 x the base's. Also an
adapter's load (read, checked, copied into its slot) and an in-place update (a new version of a
loaded adapter), medians of 5.

Adapters are written in PEFT's format by hand (random A and B): the service reads what PEFT saves.

Run: ``python -m bench.lora_mixed [--device cuda] [--new 64]`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.rows import print_rows  # noqa: E402

PROMPT = "User: describe a long walk along the sea on a windy day, in many words. Assistant:"
ROWS, ADAPTERS, RANK = 64, 4, 16
SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model, directory: Path, seed: int) -> Path:
    """A PEFT-format adapter on every projection of ``model``'s language model."""
    from safetensors.torch import save_file

    from engine.lora.adapter_files import adaptable_modules

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, linear in adaptable_modules(model).items():
        if name.rsplit(".", 1)[-1] in SUFFIXES:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(RANK, linear.in_features,
                                                                            generator=generator) * 0.02
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(linear.out_features, RANK,
                                                                            generator=generator) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(SUFFIXES)}))
    return directory


def seconds(engine, prompt: list[int], adapters: list[str], new: int) -> float:
    from engine.generation import GenerationRequest
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    results = engine.generate([GenerationRequest(prompt, params, adapter=adapters[i % len(adapters)])
                               for i in range(ROWS)])
    if engine.loaded.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    assert all(len(r.choices[0].token_ids) == new for r in results)
    return elapsed


def run(device: str, new: int) -> list[dict]:
    from transformers import AutoTokenizer

    from bench.rollout import build_bench_model
    from engine.generation import Engine
    from engine.loading import load_model

    if device == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_bench_model(Path(tmp) / "bench-qwen2-vl")
        engine = Engine(load_model(str(directory), device=device))
        dirs = [write_adapter(engine.loaded.model, Path(tmp) / f"adapter-{i}", seed=i) for i in range(ADAPTERS + 1)]
        loads = []
        for i in range(ADAPTERS):
            started = time.perf_counter()
            engine.load_adapter(f"a{i}@1", dirs[i])
            loads.append(time.perf_counter() - started)
        updates = []
        for version in range(2, 7):  # a new version of a0 each time (RL's load_inplace); the old one retires
            started = time.perf_counter()
            engine.load_adapter(f"a0@{version}", dirs[ADAPTERS])
            engine.unload_adapter(f"a0@{version - 1}")
            updates.append(time.perf_counter() - started)
        mixed_ids = [""] + [f"a{i}@1" for i in range(1, ADAPTERS)] + ["a0@6"]
        prompt = AutoTokenizer.from_pretrained(directory)(PROMPT, add_special_tokens=False)["input_ids"]
        seconds(engine, prompt, mixed_ids, 4)  # warm up
        base, mixed = [], []
        for _ in range(3):
            base.append(seconds(engine, prompt, [""], new))
            mixed.append(seconds(engine, prompt, mixed_ids, new))
    base_rate, mixed_rate = ROWS * new / min(base), ROWS * new / min(mixed)
    where = f"{device}, {ROWS} rows x {new}"
    return [
        {"name": f"decode tok/s, base alone ({where})", "value": round(base_rate, 1), "goal": None},
        {"name": f"decode tok/s, base + {ADAPTERS} adapters rank {RANK} ({where})", "value": round(mixed_rate, 1),
         "goal": None},
        {"name": "· mixed / base", "value": round(mixed_rate / base_rate, 3), "goal": ">= 0.8"},
        {"name": "adapter load, median s (read, check, copy into its slot)", "value": round(statistics.median(loads), 4),
         "goal": None},
        {"name": "in-place update, median s (new version loaded, old retired)",
         "value": round(statistics.median(updates), 4), "goal": None},
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    print_rows(run(args.device, args.new))


if __name__ == "__main__":
    main()
