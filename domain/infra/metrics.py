"""Service metrics kept in Redis, so every process (API workers, CPU and GPU workers) adds to one
set of numbers and ``GET /metrics`` can render them. prometheus-client's multiprocess mode covers
the processes of one gunicorn only; our workers are separate programs, possibly on other nodes.

Layout: ``rq:metrics:jobs_ended`` hash (status -> count), ``rq:metrics:stage:<stage>`` hash
(bucket upper bound -> count, plus ``sum`` and ``count``), ``rq:metrics:counters`` hash
(name -> count, e.g. cache hits, transport kinds).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import redis

from domain.infra.intake_order import PRIORITY_STEPS, all_lists

log = logging.getLogger(__name__)

STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STAGES = ("preprocess", "generate", "score", "queue_wait")


def observe_stage(client: redis.Redis, stage: str, *durations: float) -> None:
    """Add each of ``durations`` (seconds) to the stage's histogram, all in one round trip."""
    batch = MetricsBatch()
    batch.observe_stage(stage, *durations)
    batch.flush(client)


def count(client: redis.Redis, name: str, amount: int = 1) -> None:
    batch = MetricsBatch()
    batch.count(name, amount)
    batch.flush(client)


def record_job_ends(client: redis.Redis, jobs: list[dict]) -> None:
    batch = MetricsBatch()
    batch.job_ends(jobs)
    batch.flush(client)


class MetricsBatch:
    """Metrics gathered in a process and written together, in one round trip (``flush``). The GPU
    session's decode loop adds each step's job ends and generation times and writes them with its
    engine counters once a second: two round trips a step were on the decode thread. A crash loses
    what it had not written yet (a second's worth at most)."""

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._stages: dict[str, list[float]] = {}
        self._ended: Counter[str] = Counter()
        self._counters: Counter[str] = Counter()

    def observe_stage(self, stage: str, *durations: float) -> None:
        if durations:
            self._stages.setdefault(stage, []).extend(durations)

    def count(self, name: str, amount: int = 1) -> None:
        if amount:
            self._counters[name] += amount

    def job_ends(self, jobs: list[dict]) -> None:
        for job in jobs:
            self._ended[job["status"]] += 1
            if transport := (job.get("result") or {}).get("transport"):
                self._counters[f"transport_{transport}"] += 1

    def flush(self, client: redis.Redis) -> None:
        """Write what was gathered (nothing to write: no round trip) and start again."""
        if not (self._stages or self._ended or self._counters):
            return
        pipe = client.pipeline(transaction=False)
        for stage, durations in self._stages.items():
            key = f"rq:metrics:stage:{stage}"
            buckets = Counter(next((repr(bound) for bound in STAGE_BUCKETS if seconds <= bound), "+Inf")
                              for seconds in durations)
            for bound, hits in buckets.items():
                pipe.hincrby(key, bound, hits)
            pipe.hincrbyfloat(key, "sum", sum(durations))
            pipe.hincrby(key, "count", len(durations))
        for status, hits in self._ended.items():
            pipe.hincrby("rq:metrics:jobs_ended", status, hits)
        for name, amount in self._counters.items():
            pipe.hincrby("rq:metrics:counters", name, amount)
        self._clear()
        _best_effort(pipe)


@dataclass(frozen=True)
class StageHistogram:
    buckets: list[tuple[str, float]]  # (upper bound, cumulative count), "+Inf" last
    total_seconds: float


@dataclass(frozen=True)
class MetricsSnapshot:
    """Every number at one moment, for ``GET /metrics``."""

    queue_depths: dict[str, int]
    jobs_ended: dict[str, int]
    counters: dict[str, int]
    stages: dict[str, StageHistogram]


def snapshot(client: redis.Redis, queues: list[str]) -> MetricsSnapshot:
    """Read every number in one round trip. ``queues``: the Celery queues to report the depth of
    (kombu keeps each queue's waiting messages in a Redis list per priority step:
    domain/infra/intake_order.py)."""
    pipe = client.pipeline(transaction=False)
    for name in all_lists(queues):
        pipe.llen(name)
    pipe.hgetall("rq:metrics:jobs_ended")
    pipe.hgetall("rq:metrics:counters")
    for stage in STAGES:
        pipe.hgetall(f"rq:metrics:stage:{stage}")
    replies = pipe.execute()
    per, lists = len(PRIORITY_STEPS), len(queues) * len(PRIORITY_STEPS)
    depths = [sum(replies[i * per:(i + 1) * per]) for i in range(len(queues))]
    ended, counters, *stages = replies[lists:]
    return MetricsSnapshot(
        queue_depths=dict(zip(queues, depths, strict=True)),
        jobs_ended={name.decode(): int(value) for name, value in sorted(ended.items())},
        counters={name.decode(): int(value) for name, value in sorted(counters.items())},
        stages={stage: _histogram(raw) for stage, raw in zip(STAGES, stages, strict=True)},
    )


def _histogram(raw: dict[bytes, bytes]) -> StageHistogram:
    values = {key.decode(): float(value) for key, value in raw.items()}
    cumulative, buckets = 0.0, []
    for bound in STAGE_BUCKETS:
        cumulative += values.get(repr(bound), 0)
        buckets.append((repr(bound), cumulative))
    buckets.append(("+Inf", cumulative + values.get("+Inf", 0)))
    return StageHistogram(buckets, values.get("sum", 0.0))


def _best_effort(pipe) -> None:
    # Metrics must never fail a job.
    try:
        pipe.execute()
    except redis.RedisError as exc:
        log.debug("metrics not recorded: %s", exc)
