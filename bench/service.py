"""Service-level figures of bench/README.md, side by side in one run on the tiny demo model.

One real stack: an embedded Redis, the CPU, GPU and batches workers as subprocesses (started with
``python -m launcher.cli worker KIND``, as a deployment runs them) and the API in this process (Flask
test client). The in-process baseline is ``engine.generation.Engine`` on the same model, in this
process, with one torch thread like the workers. Everything shares the machine's cores (on a
2-core box: the benchmark, the API, three workers and Redis), so the ratios include that contention.

- submit throughput: ``POST /v1/jobs`` accepted per second, before any worker runs (no consumer);
- end-to-end throughput: the same 64 greedy requests (32 prompt ids, 32 new tokens, ignore_eos)
  submitted at once and waited for, vs the engine generating them in batches of
  ``ROLLOUT_GPU_BATCH_SIZE``; repeated, medians compared (goal >= 0.8); and the same jobs in one
  ``POST /v1/jobs/bulk`` followed by ``POST /v1/jobs/lookup`` with ``wait`` (a trainer's rollout step,
  as the Python client runs it), alternated with the other two round by round;
- added latency: jobs one at a time (max_tokens 1-4): submit, wait, GET the result, minus the
  engine's time for the same single request; p50 (goal <= 15 ms), with where the time goes;
- bulk scoring: a JSONL batch of score rows through ``POST /v1/batches`` until ``completed``,
  vs ``bench.generation_batching.score_in_process`` on the same rows (goal >= 0.8); then the same
  rows in the OpenAI Batch format (``/v1/jobs`` lines uploaded to ``/v1/files``, a JSON create
  naming the file, the results downloaded from its ``output_file_id``), as the openai client runs it.

Waiting for a job means the job store's wake-up list (``JobStore.wait``, as ``POST /generate``
waits) and then ``GET /v1/jobs/{id}``, not a polling loop. Rows marked ``·`` explain the figure
above them: the CPU milliseconds each process spent per job (from /proc and Redis' INFO) and, for
latency, each stage's p50 from the job record's own timestamps. ``ROLLOUT_*`` variables set in the
environment reach the workers, so a setting can be tried: ``ROLLOUT_GPU_BATCH_WAIT_MS=20 bench/run``.

Run: ``python -m bench.service [--score-rows 2000]`` from the repository root.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.generation_batching import score_in_process
from bench.stack import BATCH, HEADERS, NEW_TOKENS, Service, engine_request, job_body, prompt
from engine.demo_model import build_demo_model
from engine.generation import Engine
from engine.loading import load_model
from engine.scoring import ScoreRequest

# --- The measurements -----------------------------------------------------------------------------

def submit_rate(service: Service, count: int) -> float:
    """Jobs accepted per second by POST /v1/jobs, one client, no worker consuming."""
    for i in range(20):  # first-request costs are not the figure
        service.submit(job_body(i))
    started = time.perf_counter()
    for i in range(count):
        service.submit(job_body(i))
    return count / (time.perf_counter() - started)


def throughput(service: Service, engine: Engine, jobs: int, rounds: int) -> dict:
    """Median seconds for ``jobs`` requests: in-process in batches of BATCH; through the service
    submitted one ``POST /v1/jobs`` each, and in one ``POST /v1/jobs/bulk``, the three alternated
    round by round; the CPU seconds each process of the service spent per job, each way."""
    in_process, one_by_one, in_bulk = [], [], []
    cpu, bulk_cpu = CpuMeter(service), CpuMeter(service)
    for _ in range(rounds):
        started = time.perf_counter()
        for i in range(0, jobs, BATCH):
            engine.generate([engine_request(j) for j in range(i, min(i + BATCH, jobs))])
        in_process.append(time.perf_counter() - started)
        seconds, mean_batch = _service_round(
            service, cpu, jobs, lambda: [service.result(job_id) for job_id in [service.submit(job_body(i))
                                                                                for i in range(jobs)]])
        one_by_one.append(seconds)
        in_bulk.append(_service_round(
            service, bulk_cpu, jobs, lambda: service.lookup_ended(service.submit_many([job_body(i) for i in range(jobs)])))[0])
    return {"in_process_s": statistics.median(in_process), "service_s": statistics.median(one_by_one),
            "bulk_s": statistics.median(in_bulk), "mean_batch": mean_batch,
            "cpu_ms_per_job": cpu.per_item_ms(jobs * rounds), "bulk_cpu_ms_per_job": bulk_cpu.per_item_ms(jobs * rounds),
            "commands_per_job": cpu.commands / (jobs * rounds)}


def _service_round(service: Service, cpu: CpuMeter, jobs: int, run) -> tuple[float, float]:
    """Seconds from the first submit until every job's result was read (``run`` submits the jobs
    and returns them ended), and the GPU batch size the jobs ran in, on average."""
    cpu.start()
    started = time.perf_counter()
    results = run()
    elapsed = time.perf_counter() - started
    cpu.stop()
    assert len(results) == jobs and all(len(r["result"]["choices"][0]["token_ids"]) == NEW_TOKENS for r in results)
    return elapsed, statistics.mean(r["result"]["timings"]["batch_size"] for r in results)


def added_latency(service: Service, engine: Engine, jobs: int) -> dict:
    """Per job (one at a time): service wall time minus the engine's time for the same request, and
    the service's time split into stages from the job's own timestamps (p50 of each, ms)."""
    added, stages = [], []
    for i in range(jobs):
        max_tokens = 1 + i % 4
        request = engine_request(i, max_tokens)
        engine_s = min(_timed(engine.generate, [request]) for _ in range(3))
        started, wall_started = time.perf_counter(), time.time()
        job_id = service.submit(job_body(i, max_tokens))
        submitted = time.perf_counter()
        job = service.result(job_id)
        wall = time.perf_counter() - started
        added.append(wall - engine_s)
        stages.append(_stages(job, wall_started, submit_s=submitted - started, wall_s=wall, engine_s=engine_s))
    breakdown = {name: statistics.median(s[name] for s in stages) * 1e3 for name in stages[0]}
    return {"p50_ms": statistics.median(added) * 1e3, "p90_ms": _percentile(added, 0.9) * 1e3, "stages_ms": breakdown}


def _stages(job: dict, wall_started: float, *, submit_s: float, wall_s: float, engine_s: float) -> dict:
    """Where one job's time went, from the job record's timestamps (every process's time.time())."""
    timings = job["result"]["timings"]
    created, started, completed = job["created_at"], job["started_at"], job["completed_at"]
    generation_start = created + timings["queue_s"]  # the GPU worker's engine call began
    return {
        "POST /v1/jobs, whole request": submit_s,
        "POST /v1/jobs, request -> job created": created - wall_started,
        "job created -> CPU task starts": started - created,
        "preprocess (CPU task body)": timings["preprocess"],
        "CPU task starts -> GPU batch starts": generation_start - started,
        "engine in the GPU worker": timings["generate"],
        "engine in the GPU worker - in-process engine": timings["generate"] - engine_s,
        "GPU engine done -> job ended": completed - generation_start - timings["generate"],
        "job ended -> waiter has the GET result": wall_started + wall_s - completed,
    }


def bulk_scoring(service: Service, engine: Engine, rows: int, *, openai_format: bool = False) -> dict:
    completion = prompt(10_000, NEW_TOKENS)
    bodies = [{"token_ids": prompt(i), "completion_token_ids": completion} for i in range(rows)]
    if openai_format:
        lines = [json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/jobs",
                             "body": {"kind": "score", **body}}) for i, body in enumerate(bodies)]
    else:
        lines = [json.dumps({"custom_id": f"row-{i}", "kind": "score", "body": body}) for i, body in enumerate(bodies)]
    data = ("\n".join(lines) + "\n").encode()
    requests = [ScoreRequest(prompt(i), completion) for i in range(rows)]
    in_process = score_in_process(engine, requests, batch_size=BATCH)["seconds"]

    cpu = CpuMeter(service)
    cpu.start()
    started = time.perf_counter()
    if openai_format:  # what openai.files.create and openai.batches.create send
        uploaded = service.client.post("/v1/files", data={"file": (io.BytesIO(data), "rows.jsonl"), "purpose": "batch"},
                                       content_type="multipart/form-data", headers=HEADERS)
        assert uploaded.status_code == 200, uploaded.get_json()
        response = service.client.post("/v1/batches", headers=HEADERS, json={
            "input_file_id": uploaded.get_json()["id"], "endpoint": "/v1/jobs", "completion_window": "24h"})
    else:
        response = service.client.post("/v1/batches", data=data, headers={**HEADERS, "Content-Type": "application/jsonl"})
    assert response.status_code == 202, response.get_json()
    accepted = time.perf_counter() - started
    scored_at_accept = response.get_json()["request_counts"]["completed"]
    batch_url = f"/v1/batches/{response.get_json()['id']}"
    # Long polls, as the Python client's batch_wait: answered the moment the batch ends.
    while (batch := service.client.get(f"{batch_url}?wait=10", headers=HEADERS).get_json())["status"] not in (
            "completed", "failed", "cancelled", "expired"):
        pass
    elapsed = time.perf_counter() - started
    cpu.stop()
    if openai_format:
        output = service.client.get(f"/v1/files/{batch['output_file_id']}/content", headers=HEADERS)
    else:
        output = service.client.get(f"{batch_url}/output", headers=HEADERS)
    output = output.get_data(as_text=True).splitlines()
    download = time.perf_counter() - started - elapsed
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == rows, batch
    sizes = [json.loads(line)["response"]["body"]["timings"]["batch_size"] for line in output]
    assert len(sizes) == rows
    return {"in_process_s": in_process, "service_s": elapsed, "accept_s": accepted, "download_s": download,
            "scored_at_accept": scored_at_accept,
            "mean_batch": statistics.mean(sizes), "cpu_ms_per_job": cpu.per_item_ms(rows)}


class CpuMeter:
    """CPU seconds used by each process of the service between start() and stop() (summed over
    repeats): the workers (from /proc), Redis (its INFO) and this process (the API and the client)."""

    def __init__(self, service: Service):
        self.service = service
        self.total: dict[str, float] = {}
        self._at: dict[str, float] = {}
        self.commands = 0  # Redis commands run meanwhile (a script's inner calls count too)
        self._commands_at = 0

    def _now(self) -> dict[str, float]:
        now = {"API + client (bench process)": time.process_time()}
        for kind, process in self.service.workers.items():
            now[f"{kind} worker"] = process_cpu_seconds(process.pid)
        info = self.service.svc.redis.info("cpu")
        now["redis-server"] = info["used_cpu_user"] + info["used_cpu_sys"]
        return now

    def _commands(self) -> int:
        return self.service.svc.redis.info("stats")["total_commands_processed"]

    def start(self) -> None:
        self._at = self._now()
        self._commands_at = self._commands()

    def stop(self) -> None:
        for name, value in self._now().items():
            self.total[name] = self.total.get(name, 0.0) + value - self._at[name]
        self.commands += self._commands() - self._commands_at

    def per_item_ms(self, items: int) -> dict[str, float]:
        return {name: seconds / items * 1e3 for name, seconds in self.total.items()}


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (0 once it is gone), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _timed(call, *args) -> float:
    started = time.perf_counter()
    call(*args)
    return time.perf_counter() - started


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(jobs: int = 64, rounds: int = 5, latency_jobs: int = 40, score_rows: int = 2000,
        submits: int = 500) -> list[dict]:
    """The service rows of the benchmark table: ``{name, value, goal}`` (goal None: reported only)."""
    torch.set_num_threads(1)  # as the workers run (ROLLOUT_TORCH_THREADS=1)
    with tempfile.TemporaryDirectory(prefix="rq-bench-") as tmp:
        state = Path(tmp)
        model_dir = build_demo_model(state / "model")
        service = Service(state, model_dir)
        try:
            rate = submit_rate(service, submits)
            service.svc.redis.flushdb()  # the jobs above must not reach the workers
            service.start_workers()
            engine = Engine(load_model(str(model_dir), device="cpu"))
            service.wait_ready()
            # Warm up both sides: the first task after a worker starts is slow (docs/architecture.md).
            for job_id in [service.submit(job_body(i)) for i in range(BATCH)]:
                service.result(job_id)
            engine.generate([engine_request(i) for i in range(BATCH)])
            flow = throughput(service, engine, jobs, rounds)
            latency = added_latency(service, engine, latency_jobs)
            scoring = bulk_scoring(service, engine, score_rows)
            openai_scoring = bulk_scoring(service, engine, score_rows, openai_format=True)
        finally:
            service.close()
    rows = [
        _row(f"service end-to-end throughput / in-process engine ({jobs} jobs, median of {rounds})",
             flow["in_process_s"] / flow["service_s"], ">= 0.8"),
        _row(f"· in-process engine, {jobs} jobs in batches of {BATCH} (s)", flow["in_process_s"]),
        _row(f"· service, {jobs} jobs submitted at once until all ended (s)", flow["service_s"]),
        _row("· service: mean GPU batch size", flow["mean_batch"]),
        _row("· in-process engine: CPU ms per job", flow["in_process_s"] / jobs * 1e3),
        *(_row(f"· service: CPU ms per job, {name}", ms) for name, ms in flow["cpu_ms_per_job"].items()),
        _row("· service: Redis commands per job (INFO's total; a script's own calls count)", flow["commands_per_job"]),
        _row(f"service end-to-end, the {jobs} jobs in one POST /v1/jobs/bulk / in-process engine (median of {rounds})",
             flow["in_process_s"] / flow["bulk_s"]),
        _row(f"· service, {jobs} jobs in one POST /v1/jobs/bulk until all ended (s)", flow["bulk_s"]),
        *(_row(f"· service in bulk: CPU ms per job, {name}", ms) for name, ms in flow["bulk_cpu_ms_per_job"].items()),
        _row(f"added latency per job over in-process, p50 (ms, {latency_jobs} sequential jobs)",
             latency["p50_ms"], "<= 15"),
        _row("· added latency per job, p90 (ms)", latency["p90_ms"]),
        *(_row(f"· p50 {stage} (ms)", ms) for stage, ms in latency["stages_ms"].items()),
        _row(f"bulk scoring throughput / in-process scoring loop ({score_rows} rows)",
             scoring["in_process_s"] / scoring["service_s"], ">= 0.8"),
        _row(f"· in-process scoring loop, {score_rows} rows in batches of {BATCH} (s)", scoring["in_process_s"]),
        _row(f"· service: POST /v1/batches until completed, {score_rows} rows (s)", scoring["service_s"]),
        _row("· service: of which POST /v1/batches accepting the file (s)", scoring["accept_s"]),
        _row("· service: rows already scored when it answered (scored while the file is read)",
             scoring["scored_at_accept"]),
        _row("· service: mean GPU batch size while scoring", scoring["mean_batch"]),
        _row("· in-process scoring loop: CPU ms per row", scoring["in_process_s"] / score_rows * 1e3),
        *(_row(f"· service: CPU ms per row, {name}", ms) for name, ms in scoring["cpu_ms_per_job"].items()),
        _row(f"bulk scoring, OpenAI Batch format (/v1/files + JSON create + output file) / in-process loop "
             f"({score_rows} rows)", openai_scoring["in_process_s"] / openai_scoring["service_s"], ">= 0.8"),
        _row(f"· service: upload, create, until completed, {score_rows} rows (s)",
             openai_scoring["service_s"]),
        _row("· service: of which /v1/files + POST /v1/batches accepting the file (s)", openai_scoring["accept_s"]),
        _row("· then downloading the output file, rendered as OpenAI lines (s)", openai_scoring["download_s"]),
        _row(f"submit throughput, POST /v1/jobs per s (test client, no workers; {submits} jobs)", rate),
    ]
    return rows


def _row(name: str, value: float, goal: str | None = None) -> dict:
    return {"name": name, "value": round(value, 3 if abs(value) < 10 else 1), "goal": goal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency-jobs", type=int, default=40)
    parser.add_argument("--score-rows", type=int, default=2000)
    parser.add_argument("--submits", type=int, default=500)
    args = parser.parse_args()
    rows = run(args.jobs, args.rounds, args.latency_jobs, args.score_rows, args.submits)
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        print(f"{row['name']:<{width}}  {row['value']:>10}  {row['goal'] or ''}")


if __name__ == "__main__":
    main()
