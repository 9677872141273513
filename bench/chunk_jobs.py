"""Making a batch chunk's jobs: one call per job beside one per chunk (issue #29, item 2).

The batches worker turns each chunk of generation lines into jobs (``workers/tasks/batches.py``).
Until ``submit_jobs`` it made them one at a time: per line the job's create script (a round trip),
its message and its line's mapping (another round trip). Now a chunk's jobs are created in one
pipeline, their mappings written in one, and their messages sent through one producer in one more
(kombu's publish batch: 416 -> 252 µs a job here): still one message per job, because a GPU worker reserves messages, not jobs (a message naming a chunk's 64
jobs was tried: 120 µs a job here, but a worker's prefetch of 2 x its rows messages would then hold
up to 128 x its rows jobs that the fleet's other GPU workers could not take).

Side by side in one process on an embedded Redis, the same 2,048 plain-token requests in chunks of
64, alternated, the best of three rounds each: the batches worker's time per job either way.

Run: ``python -m bench.chunk_jobs`` from the repository root (about 15 s).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.rows import print_rows
from domain.infra.intake_order import waiting
from domain.infra.redis_server import EmbeddedRedis
from domain.jobs.request import JobRequest
from domain.jobs.store import QueueFullError
from domain.jobs.submission import submit_job, submit_jobs
from domain.names import SHARED_GENERATE_QUEUE
from domain.settings import Settings
from engine.demo_model import build_demo_model
from web.api.schemas import JobRequestSchema
from workers.runtime import Runtime

JOBS = 2048
CHUNK = 64  # ROLLOUT_BATCH_CHUNK_SIZE's default
OWNER = "bench-owner"
BATCH_ID = "batch_bench"


def run(jobs: int = JOBS, rounds: int = 3) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        server = EmbeddedRedis(state / "redis", persistent=False).start()
        try:
            settings = Settings(state_dir=state, model=str(build_demo_model(state / "model")),
                                max_queued_per_key=10**8, max_queued_total=10**8)
            rt = Runtime(settings, server.url)
            schema = JobRequestSchema()  # the request as the API stores a batch line's
            requests = [JobRequest.from_dict(schema.load({"token_ids": [100 + (i * 7 + k) % 500 for k in range(32)],
                                                          "sampling_params": {"max_tokens": 32}})) for i in range(jobs)]
            expire_at = int(time.time()) + 3600

            def one_by_one(chunk: list[JobRequest], first_line: int) -> None:
                for line, request in enumerate(chunk, start=first_line):
                    job = submit_job(rt.jobs, rt.celery, owner=OWNER, request=request, model=rt.model_facts,
                                     extra={"batch_id": BATCH_ID, "line": str(line)})
                    rt.batches.set_line_job(BATCH_ID, line, job["id"], expire_at=expire_at)

            def per_chunk(chunk: list[JobRequest], first_line: int) -> None:
                outcomes = submit_jobs(rt.jobs, rt.celery, owner=OWNER, model=rt.model_facts, requests=[
                    (request, {"batch_id": BATCH_ID, "line": str(line)}) for line, request in enumerate(chunk, first_line)])
                assert not any(isinstance(job, QueueFullError) for job in outcomes)
                rt.batches.set_line_jobs(BATCH_ID, {line: job["id"] for line, job in enumerate(outcomes, first_line)},
                                         expire_at=expire_at)

            ways = {"one by one": one_by_one, "per chunk": per_chunk}
            per_chunk(requests[:CHUNK], 1)  # warm-up: connections, scripts, the producer pool
            one_by_one(requests[:CHUNK], 1)
            best = dict.fromkeys(ways, float("inf"))
            messages = {}
            for _ in range(rounds):
                for name, make in ways.items():
                    [queued] = waiting(rt.redis, [SHARED_GENERATE_QUEUE])
                    started = time.perf_counter()
                    for start in range(0, jobs, CHUNK):
                        make(requests[start:start + CHUNK], start + 1)
                    best[name] = min(best[name], (time.perf_counter() - started) / jobs)
                    messages[name] = (waiting(rt.redis, [SHARED_GENERATE_QUEUE])[0] - queued) / jobs
        finally:
            server.stop()
    return [
        {"name": f"a batch chunk's jobs made, the chunk at once / one job at a time ({CHUNK}-line chunks)",
         "value": round(best["per chunk"] / best["one by one"], 3), "goal": None},
        {"name": f"· per job: one at a time {best['one by one'] * 1e6:.0f} µs, the chunk at once "
                 f"{best['per chunk'] * 1e6:.0f} µs; GPU queue messages per job {messages['one by one']:.2f} / "
                 f"{messages['per chunk']:.2f}", "value": round(best["per chunk"] * 1e6), "goal": None, "unit": "µs"},
    ]


if __name__ == "__main__":
    print_rows(run())
