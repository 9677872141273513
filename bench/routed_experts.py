"""What returning routed experts costs (issue #59): decode tokens/s of the MoE demo (Qwen3-MoE,
2 sparse layers, top 2 of 8) with every row asking for its routed experts against none asking, in
one process on one torch thread: 32 rows x 64 tokens at temperature 1, in seven
alternating pairs (the prefix cache dropped before each run, so both compute their prompt): the
rates are each side's fastest, the ratio the median of the pairs' own ratios (one pair hit by
another process's burst moves a median of seven little). On a CPU the time is the process's CPU time (``time.process_time``: a machine
shared with other work skews wall time by more than the difference measured); on a GPU, wall time. Also the hooks' cost when no row asks: one unarmed router hook call, in ns (each
forward makes one per MoE layer). Goal: with / without >= 0.9.

Run: ``python -m bench.routed_experts`` from the repository root (``--device cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
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
ROWS, NEW, ROUNDS = 32, 64, 7


def seconds(engine, prompt: list[int], routed: bool) -> tuple[float, int]:
    from engine.generation import GenerationRequest
    from engine.sampling_params import SamplingParams

    engine.forget_cached()
    requests = [GenerationRequest(prompt, SamplingParams(max_tokens=NEW, temperature=1.0, seed=i, ignore_eos=True,
                                                         routed_experts=routed)) for i in range(ROWS)]
    cuda = engine.loaded.device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    if cuda:
        torch.cuda.synchronize()
    started = clock()
    results = engine.generate(requests)
    elapsed = clock() - started
    if routed:  # every row's ids came back, all positions
        assert all(r.choices[0].routed_experts["shape"][0] == len(prompt) + NEW - 1 for r in results)
    return elapsed, sum(len(r.choices[0].token_ids) for r in results)


def unarmed_hook_ns(engine) -> float:
    """One router hook call when no row asked: what every MoE layer pays per forward."""
    from engine.routing.capture import router_capture

    capture = router_capture(engine.loaded.model)
    hook = capture._hook(capture.top_k)
    output = (None, None, torch.zeros(1, capture.top_k, dtype=torch.long))
    calls = 200_000
    started = time.perf_counter()
    for _ in range(calls):
        hook(None, (), output)
    return (time.perf_counter() - started) / calls * 1e9


def run(device: str = "cpu") -> list[dict]:
    from transformers import AutoTokenizer

    from engine.demo_model import build_demo_model
    from engine.generation import Engine
    from engine.loading import load_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_demo_model(Path(tmp) / "qwen3_moe", arch="qwen3_moe")
        engine = Engine(load_model(str(directory), device=device))
        prompt = AutoTokenizer.from_pretrained(directory)(PROMPT, add_special_tokens=False)["input_ids"]
        seconds(engine, prompt, True)  # warm up
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(ROUNDS):
            for routed in (False, True):
                elapsed, tokens = seconds(engine, prompt, routed)
                rates[routed].append(tokens / elapsed)
        plain, routed = max(rates[False]), max(rates[True])
        ratio = statistics.median(r / p for p, r in zip(rates[False], rates[True], strict=True))
        hook = unarmed_hook_ns(engine)
    label = f"MoE demo on {device}, {ROWS} rows x {NEW}"
    return [{"name": f"decode tok/s, {label}, without routed experts", "value": round(plain, 1), "goal": None},
            {"name": f"decode tok/s, {label}, with routed experts", "value": round(routed, 1), "goal": None},
            {"name": f"· with / without (median of {ROUNDS} pairs), {label}", "value": round(ratio, 3),
             "goal": ">= 0.9"},
            {"name": "· unarmed router hook call, ns (per MoE layer per forward)", "value": round(hook, 1),
             "goal": None}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    print_rows(run(parser.parse_args().device))


if __name__ == "__main__":
    main()
