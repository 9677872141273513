"""Heartbeats (domain/infra/heartbeats.py): readers find every kind's live workers through its
index, whatever else the keyspace holds; a lapsed key is not live; stale index entries go."""

from __future__ import annotations

import pytest
import redis

from domain.infra import heartbeats
from domain.infra.heartbeats import alive_workers, any_alive, beat, live, statuses, vanished
from tests.conftest import empty_db_url


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(empty_db_url(redis_url, 22)) as client:
        yield client


def test_live_workers_are_read_from_the_index_not_a_scan(client, monkeypatch):
    client.mset({f"rq:job:{i}": "x" for i in range(500)})  # the keyspace of a busy service
    beat(client, "gpu", "node-1", {"model_ready": False})
    beat(client, "gpu", "node-2", {"model_ready": True})
    beat(client, "cpu", "node-1", {})
    monkeypatch.setattr(redis.Redis, "scan_iter", lambda *a, **k: pytest.fail("scanned the keyspace"))
    assert {key for key in live(client, ("gpu",))} == {"rq:worker:gpu:node-1", "rq:worker:gpu:node-2"}
    assert alive_workers(client)["gpu"]["model_ready"] is True and set(alive_workers(client)) == {"gpu", "cpu"}
    assert len(statuses(client, "gpu")) == 2 and any_alive(client, "cpu") and not any_alive(client, "webhooks")
    client.delete("rq:worker:gpu:node-1")  # its TTL ran out: the index still names it, the key says dead
    assert [s["model_ready"] for s in statuses(client, "gpu")] == [True]


def test_a_vanished_heartbeat_is_named_once(client):
    beat(client, "gpu", "node-1", {})
    assert vanished(client, ("gpu", "cpu"), "rq:seen") == set()
    client.delete("rq:worker:gpu:node-1")
    assert vanished(client, ("gpu", "cpu"), "rq:seen") == {"rq:worker:gpu:node-1"}
    assert vanished(client, ("gpu", "cpu"), "rq:seen") == set()


def test_index_entries_of_workers_long_gone_are_dropped(client, monkeypatch):
    beat(client, "batches", "old", {})
    client.delete("rq:worker:batches:old")
    now = heartbeats.time.time()
    monkeypatch.setattr(heartbeats.time, "time", lambda: now + heartbeats.INDEX_KEEP_S + 1)
    beat(client, "batches", "new", {})
    assert set(live(client, ("batches",))) == {"rq:worker:batches:new"}
    assert client.zrange("rq:workers:batches", 0, -1) == [b"new"]
