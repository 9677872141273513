"""The service as a user runs it: the API under gunicorn (``rollout-queue api``, its defaults) on
loopback HTTP, and the bundled Python client, against the in-process engine on the same requests.

Each round the client submits 64 greedy jobs (32 prompt ids, 32 new tokens), one ``POST /v1/jobs``
each on one keep-alive session (and again, alternated, all in one ``POST /v1/jobs/bulk``), then follows them as a trainer follows a step's rollouts: one
``POST /v1/jobs/lookup`` with ``wait`` (answered once every job ended) until all have ended. The
in-process engine runs the same requests in batches of 16. Reported beside the ratio: the CPU each
process of the stack spent per job (the API's gunicorn processes, the client, the workers, Redis).

    python -m bench.http_service --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch
from rollout_queue_client import RolloutClient

from bench.rows import print_rows
from bench.service import CpuMeter, _row, process_cpu_seconds
from bench.stack import BATCH, KEY, ROOT, Service, engine_request, job_body
from domain.infra.redis_server import free_port
from engine.demo_model import build_demo_model
from engine.generation import Engine
from engine.loading import load_model

JOBS = 64


def start_api(service: Service) -> str:
    """``rollout-queue api`` on a free port with the service's settings; its URL once it answers."""
    port = free_port()
    with open(service.state / "api.log", "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "launcher.cli", "api"], cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT,
                                   env={**os.environ, **service.env, "ROLLOUT_PORT": str(port)})
    service.workers["api"] = process  # stopped with the workers
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the API exited:\n{(service.state / 'api.log').read_text()[-3000:]}")
        try:
            requests.get(f"{url}/healthz", timeout=5)
            return url
        except requests.RequestException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class StackCpu(CpuMeter):
    """The service's CPU meter with the API's gunicorn workers counted beside its arbiter."""

    def _now(self) -> dict[str, float]:
        now = super()._now()
        arbiter = self.service.workers["api"].pid
        now["api worker"] += sum(process_cpu_seconds(pid) for pid in _children(arbiter))
        return now


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (gunicorn's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError):  # gone meanwhile
            continue
    return found



def one_round(client: RolloutClient, base: int, *, bulk: bool = False) -> float:
    """Seconds to submit JOBS jobs (one request each, or all in one bulk request) until all ended."""
    started = time.perf_counter()
    if bulk:
        ids = [job["id"] for job in client.submit_many([job_body(base + i) for i in range(JOBS)])]
    else:
        ids = [client.submit(job_body(base + i))["id"] for i in range(JOBS)]
    while True:
        jobs = client.lookup(ids, wait=30)["data"]
        if len(jobs) == JOBS and all(job["status"] in ("succeeded", "failed", "cancelled") for job in jobs):
            break
    elapsed = time.perf_counter() - started
    assert all(job["status"] == "succeeded" for job in jobs), [job["status"] for job in jobs]
    return elapsed


def run(rounds: int = 5) -> list[dict]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rq-bench-http-") as tmp:
        state = Path(tmp)
        model_dir = build_demo_model(state / "model")
        service = Service(state, model_dir)
        try:
            service.start_workers()
            engine = Engine(load_model(str(model_dir), device="cpu"))
            service.wait_ready()
            url = start_api(service)
            cpu, bulk_cpu = StackCpu(service), StackCpu(service)
            in_process, over_http, in_bulk = [], [], []
            with RolloutClient(url, KEY) as client:
                one_round(client, 50_000)  # warm-up: the first task after a start is slow
                engine.generate([engine_request(i) for i in range(BATCH)])
                for r in range(rounds):
                    started = time.perf_counter()
                    for i in range(0, JOBS, BATCH):
                        engine.generate([engine_request(60_000 + r * JOBS + j) for j in range(i, i + BATCH)])
                    in_process.append(time.perf_counter() - started)
                    cpu.start()
                    over_http.append(one_round(client, 60_000 + r * JOBS))
                    cpu.stop()
                    bulk_cpu.start()  # prompts of their own (prompt() repeats every 500), so no more cached
                    in_bulk.append(one_round(client, 60_250 + r * JOBS, bulk=True))
                    bulk_cpu.stop()
        finally:
            service.close()
    per_job, bulk_per_job = _stack_share(cpu, rounds), _stack_share(bulk_cpu, rounds)
    http_s, engine_s, bulk_s = statistics.median(over_http), statistics.median(in_process), statistics.median(in_bulk)
    rows = [
        _row(f"service over HTTP (gunicorn, the Python client: {JOBS} submits, then lookup with wait) / "
             f"in-process engine (median of {rounds})", engine_s / http_s, ">= 0.8"),
        _row(f"· in-process engine, {JOBS} jobs in batches of {BATCH} (s)", engine_s),
        _row(f"· over HTTP, {JOBS} jobs submitted until all ended (s)", http_s),
        _row("· over HTTP: CPU ms per job, summed over the stack's processes", sum(per_job.values()), "<= 3"),
    ]
    rows += [_row(f"· over HTTP: CPU ms per job, {name}", value) for name, value in per_job.items()]
    rows += [
        _row(f"service over HTTP, the {JOBS} jobs in one POST /v1/jobs/bulk (the client's submit_many), then lookup "
             f"with wait / in-process engine (median of {rounds})", engine_s / bulk_s),
        _row(f"· over HTTP in bulk, {JOBS} jobs submitted until all ended (s)", bulk_s),
        _row("· over HTTP in bulk: CPU ms per job, summed over the stack's processes", sum(bulk_per_job.values())),
    ]
    rows += [_row(f"· over HTTP in bulk: CPU ms per job, {name}", value) for name, value in bulk_per_job.items()]
    return rows


def _stack_share(cpu: StackCpu, rounds: int) -> dict[str, float]:
    """CPU ms per job by process. The bench process holds the client and the in-process baseline;
    only the client's share is the stack's (the meter runs around the service's rounds alone)."""
    per_job = cpu.per_item_ms(JOBS * rounds)
    per_job["client (bench process)"] = per_job.pop("API + client (bench process)")
    return per_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    print_rows(run(parser.parse_args().rounds))


if __name__ == "__main__":
    main()
