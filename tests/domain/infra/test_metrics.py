"""Metrics gathered in a process and written in one round trip (domain/infra/metrics.py
``MetricsBatch``), against a real Redis: what a batch writes is what the one-shot calls write."""

from __future__ import annotations

import pytest
import redis

from domain.infra.metrics import MetricsBatch, count, observe_stage, record_job_ends
from domain.infra.redis_server import EmbeddedRedis
from tests.conftest import empty_db_url

ENDS = [{"status": "succeeded", "result": {"transport": "shm"}}, {"status": "failed"}, {"status": "succeeded"}]


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(empty_db_url(redis_url, 23)) as client:
        yield client


def metrics(client: redis.Redis) -> dict:
    return {key: client.hgetall(key) for key in sorted(client.keys("rq:metrics:*"))}


def test_a_batch_writes_what_the_one_shot_calls_write(client):
    batch = MetricsBatch()
    batch.observe_stage("generate", 0.2)
    batch.observe_stage("generate", 0.03, 0.04, 500.0)
    batch.count("mm_cache_hit", 3)
    batch.job_ends(ENDS)
    assert metrics(client) == {}  # nothing before the flush
    batch.flush(client)
    written = metrics(client)
    client.flushdb()
    observe_stage(client, "generate", 0.2, 0.03, 0.04, 500.0)  # one sum, as the batch's
    count(client, "mm_cache_hit", 3)
    record_job_ends(client, ENDS)
    assert written == metrics(client)  # the one-shot calls are batches of one call now: check the values too
    assert written[b"rq:metrics:jobs_ended"] == {b"succeeded": b"2", b"failed": b"1"}
    assert written[b"rq:metrics:counters"] == {b"mm_cache_hit": b"3", b"transport_shm": b"1"}
    stage = written[b"rq:metrics:stage:generate"]
    assert stage[b"count"] == b"4" and float(stage[b"sum"]) == pytest.approx(500.27)
    assert stage[b"+Inf"] == b"1" and sum(int(hits) for bound, hits in stage.items()
                                          if bound not in (b"count", b"sum")) == 4


def test_a_flush_writes_each_thing_once_and_nothing_when_empty(tmp_path):
    # A Redis of its own: its command count is this test's alone (the suite's shared one serves
    # other tests' leftover threads too).
    server = EmbeddedRedis(tmp_path / "redis", persistent=False).start()
    try:
        with redis.Redis.from_url(server.url) as client:
            batch = MetricsBatch()
            batch.count("x", 2)
            batch.flush(client)
            before = client.info("stats")["total_commands_processed"]
            batch.flush(client)  # nothing gathered since: no round trip
            assert client.info("stats")["total_commands_processed"] == before + 1  # the INFO alone
            assert client.hget("rq:metrics:counters", "x") == b"2"
    finally:
        server.stop()
