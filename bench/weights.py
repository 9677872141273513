"""Weight updates (issue #19): how long from ``POST /v1/weights`` to every GPU worker serving the
new version, idle and under load, and what the update costs the jobs running beside it.

One real stack as in :mod:`bench.service` (embedded Redis, CPU and GPU workers as subprocesses,
the API in this process), on the tiny demo model; the two checkpoints are the demo model built
with two weight seeds, as an RL trainer's consecutive steps would be.

- idle: the call's wall time with no job running (median of a few alternating updates);
- under load: 64 greedy jobs (32 prompt ids, 32 new tokens) submitted at once, with an update in
  mode ``finish`` issued as the first of them ends; the call's wall time, and the 64 jobs' wall
  time against the same 64 jobs with no update (the throughput dip: the running rows finish on
  the old weights, new rows wait for the swap).

Run: ``python -m bench.weights`` from the repository root.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.rows import print_rows
from bench.stack import Service, job_body
from engine.demo_model import build_demo_model

ADMIN = "bench-admin"
JOBS = 64
IDLE_UPDATES = 4


def update(service: Service, step: str, version: str, mode: str = "finish") -> float:
    """Seconds for ``POST /v1/weights`` to answer with every live GPU worker serving ``version``."""
    started = time.perf_counter()
    response = service.client.post("/v1/weights", json={"model_path": step, "weight_version": version, "mode": mode},
                                   headers={"Authorization": f"Bearer {ADMIN}"})
    elapsed = time.perf_counter() - started
    body = response.get_json()
    assert response.status_code == 200 and body["success"], body
    return elapsed


def run_jobs(service: Service, *, update_to: tuple[str, str] | None = None) -> tuple[float, float | None]:
    """Wall seconds for JOBS jobs submitted at once; with ``update_to``, an update issued as the
    first job ends (returns its call time too)."""
    started = time.perf_counter()
    ids = [service.submit(job_body(i)) for i in range(JOBS)]
    call = None
    if update_to is not None:
        service.result(ids[0])
        call = update(service, *update_to)
    for job_id in ids:
        service.result(job_id)
    return time.perf_counter() - started, call


def run() -> list[dict]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        root = Path(tmp) / "checkpoints"
        for seed in (0, 1):
            build_demo_model(root / f"step-{seed}", seed=seed)
        service = Service(Path(tmp) / "state", root / "step-0", admin_key=ADMIN, weights_root=root)
        try:
            service.start_workers()
            service.wait_ready()
            run_jobs(service)  # warm-up: first-request costs are not the figure
            idle = [update(service, f"step-{n % 2}", f"idle-{n}") for n in range(1, IDLE_UPDATES + 1)]
            plain, _ = run_jobs(service)
            with_update, call = run_jobs(service, update_to=("step-1", "load-1"))
        finally:
            service.close()
    return [
        {"name": "weight update, call to every GPU worker serving, idle (demo model, median)",
         "value": round(statistics.median(idle), 3), "goal": None, "unit": "s"},
        {"name": f"weight update under load (mode finish, {JOBS} jobs running), call to serving",
         "value": round(call, 3), "goal": None, "unit": "s"},
        {"name": f"· {JOBS} jobs with an update among them / without (wall time)",
         "value": round(with_update / plain, 3), "goal": None, "unit": "ratio"},
    ]


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
