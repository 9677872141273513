"""Service metrics kept in Redis, so every process (API workers, CPU and GPU workers) adds to one
set of numbers and ``GET /metrics`` can render them. prometheus-client's multiprocess mode covers
the processes of one gunicorn only; our workers are separate programs, possibly on other nodes.

Layout: ``rq:metrics:jobs_ended`` hash (status -> count), ``rq:metrics:stage:<stage>`` hash
(bucket upper bound -> count, plus ``sum`` and ``count``), ``rq:metrics:counters`` hash
(name -> count, e.g. cache hits, transport kinds).
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)

STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STAGES = ("preprocess", "generate", "score", "queue_wait")


def observe_stage(client: redis.Redis, stage: str, seconds: float) -> None:
    key = f"rq:metrics:stage:{stage}"
    pipe = client.pipeline(transaction=False)
    for bound in STAGE_BUCKETS:
        if seconds <= bound:
            pipe.hincrby(key, repr(bound), 1)
            break
    else:
        pipe.hincrby(key, "+Inf", 1)
    pipe.hincrbyfloat(key, "sum", seconds)
    pipe.hincrby(key, "count", 1)
    _best_effort(pipe)


def count(client: redis.Redis, name: str, amount: int = 1) -> None:
    _best_effort(client.pipeline(transaction=False).hincrby("rq:metrics:counters", name, amount))


def record_job_ends(client: redis.Redis, jobs: list[dict]) -> None:
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        pipe.hincrby("rq:metrics:jobs_ended", job["status"], 1)
        transport = (job.get("result") or {}).get("transport")
        if transport:
            pipe.hincrby("rq:metrics:counters", f"transport_{transport}", 1)
    _best_effort(pipe)


def _best_effort(pipe) -> None:
    # Metrics must never fail a job.
    try:
        pipe.execute()
    except redis.RedisError as exc:
        log.debug("metrics not recorded: %s", exc)
