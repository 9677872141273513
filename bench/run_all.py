"""Every benchmark in one run: the goals table of bench/README.md plus submit throughput, in a few minutes on 2 cores.

Each module runs in its own interpreter (``python -m bench.run_all --module NAME`` prints its rows
as JSON), one after the other, so none inherits another's threads, torch settings or Redis; a
module that fails becomes an ``error`` row and the others still run. The table goes to stdout and
to ``bench/results/latest.md``. The exit status is 0 even when a goal is missed: this is a report.

Run: ``bench/run`` (or ``python -m bench.run_all [--only service ...]``) from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "latest.md"
# In the order of bench/README.md's table: the service module carries the end-to-end, latency and bulk-scoring figures.
MODULES = ("service", "http_service", "preprocess_cache", "media_cache", "transport", "generation_batching", "uniform_batches",
           "sampling_mask", "update_modes",
           "kv_memory", "rollout", "streaming", "message_take", "batch_submit", "weights", "durability",
           "argument_schemas", "message_publish", "chunk_jobs", "batch_intake", "arrivals", "responses", "prefix_reuse",
           "grpo_fleet", "stream_memory", "tenant_load", "intake_order", "redis_bound", "job_listing", "affinity_routes", "structured_output",
           "routed_experts", "token_turns")
MODULE_TIMEOUT_S = 600


def module_rows(name: str) -> list[dict]:
    """The rows of one benchmark module, run in this process."""
    if name == "batch_submit":
        from bench import batch_submit

        rows = []
        for kind, lines, tokens, mib, accepted, _ in batch_submit.run(10_000, [50, 200], create_jobs=False,
                                                                      formats=("native", "openai")):
            rows.append({"name": f"batch accept, {kind}: {lines:,} lines x {tokens} ids ({mib:.1f} MiB), s",
                         "value": round(accepted, 2), "goal": f"< {batch_submit.GOAL_SECONDS:g}"})
        overlapped, in_line = batch_submit.overlap(10_000, 200, rounds=2)
        rows.append({"name": f"· 10,000 chat lines x 200 words checked, tokenizer in a thread / in line "
                             f"({overlapped:.2f} / {in_line:.2f} s)", "value": round(overlapped / in_line, 2), "goal": ""})
        return rows
    module = __import__(f"bench.{name}", fromlist=["run"])
    rows = module.run()
    for row in rows:  # some modules give a unit apart: put it in the name
        if row.get("unit") not in (None, "ratio"):
            row["name"] += f" ({row['unit']})"
    return [{"name": row["name"], "value": row["value"], "goal": row["goal"]} for row in rows]


def collect(name: str) -> tuple[list[dict], float]:
    """Run one module in a child interpreter; its rows and its wall time."""
    started = time.perf_counter()
    try:
        child = subprocess.run([sys.executable, "-m", "bench.run_all", "--module", name], cwd=ROOT,
                               capture_output=True, text=True, timeout=MODULE_TIMEOUT_S,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"})
        if child.returncode == 0:
            return json.loads(child.stdout.strip().splitlines()[-1]), time.perf_counter() - started
        detail = (child.stderr.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired:
        detail = f"timed out after {MODULE_TIMEOUT_S} s"
    return [{"name": f"{name}: FAILED ({detail})", "value": "error", "goal": None}], time.perf_counter() - started


def verdict(value, goal: str | None) -> str:
    if not goal:
        return ""
    match = re.fullmatch(r"\s*(<=|>=|<|>)\s*([0-9.]+)\s*", goal)
    if not match or not isinstance(value, (int, float)):
        return "?"
    op, bound = match.group(1), float(match.group(2))
    met = {"<=": value <= bound, ">=": value >= bound, "<": value < bound, ">": value > bound}[op]
    return "pass" if met else "FAIL"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    import torch

    return (f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, CUDA "
            f"{'yes: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no'}")


def git_revision() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return (git("rev-parse", "--short", "HEAD") or "unknown") + dirty


def render(rows: list[dict], header: list[str]) -> str:
    width = max(len(row["name"]) for row in rows)
    lines = [*header, "", f"| {'figure':<{width}} | {'value':>10} | {'goal':<6} | result |",
             f"|{'-' * (width + 2)}|{'-' * 12}|{'-' * 8}|--------|"]
    for row in rows:
        value = row["value"]
        shown = f"{value:.3f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)
        lines.append(f"| {row['name']:<{width}} | {shown:>10} | {row['goal'] or '':<6} | "
                     f"{verdict(value, row['goal']):<6} |")
    goals = [verdict(row["value"], row["goal"]) for row in rows if row["goal"]]
    lines += ["", f"{goals.count('pass')} of {len(goals)} goals met."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=MODULES, help="run these modules only")
    parser.add_argument("--module", choices=MODULES, help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args(argv)
    if args.module:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the rows only
            rows = module_rows(args.module)
        print(json.dumps(rows))
        return 0

    started, load_before = time.perf_counter(), os.getloadavg()
    rows, timings = [], []
    for name in args.only or MODULES:
        print(f"running bench.{name} ...", file=sys.stderr, flush=True)
        module, seconds = collect(name)
        rows += module
        timings.append(f"{name} {seconds:.0f} s")
    header = [
        f"# Rollout Queue benchmarks, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"- revision: {git_revision()}",
        f"- machine: {machine()}",
        f"- load average before / after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f} "
        "(other work on the machine skews every figure)",
        f"- wall time: {time.perf_counter() - started:.0f} s ({', '.join(timings)})",
        "- rows starting with · explain the goal row above them; rows without a goal are reported only",
    ]
    table = render(rows, header)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(table)
    print(table)
    print(f"written to {RESULTS.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
