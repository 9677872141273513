"""Which unacknowledged generate messages no live GPU worker holds (workers/gpu/held_messages.py), on a
real Redis laid out as kombu's Redis transport lays it out (``unacked`` hash, ``unacked_index``)."""

from __future__ import annotations

import json

import pytest
from kombu.transport.redis import Channel

from tests.conftest import empty_db_url
from workers.gpu.held_messages import MARGIN_S, orphaned_generate_messages
from workers.infra.heartbeats import beat
from workers.names import GENERATE_TASK, PREPROCESS_TASK


@pytest.fixture
def client(redis_url):
    import redis

    with redis.Redis.from_url(empty_db_url(redis_url, 21)) as client:
        yield client


def _unacked(client, tag: str, task: str, reserved_at: float) -> None:
    message = {"headers": {"task": task, "argsrepr": "('job_x',)"}, "body": "", "properties": {}}
    client.hset(Channel.unacked_key, tag, json.dumps([message, "", "generate.shared"]))
    client.zadd(Channel.unacked_index_key, {tag: reserved_at})


def _beat(client, name: str, at: float, held: list[str]) -> None:
    beat(client, "gpu", name, {"at": at, "model_ready": True, "held": held})


def test_only_generate_messages_no_live_worker_holds_and_reported_since_are_orphans(client):
    now = 1_000_000.0
    _unacked(client, "held", GENERATE_TASK, now - 60)
    _unacked(client, "orphan", GENERATE_TASK, now - 60)
    _unacked(client, "just-reserved", GENERATE_TASK, now - 1)  # a live worker may not have reported it yet
    _unacked(client, "a-cpu-task", PREPROCESS_TASK, now - 60)  # not ours to restore
    _beat(client, "gpu-1", now - 0.5, ["held"])
    _beat(client, "gpu-2", now - 1.0, [])
    assert orphaned_generate_messages(client, now=now) == ["orphan"]


def test_with_no_live_gpu_worker_every_generate_message_past_the_margin_is_an_orphan(client):
    now = 1_000_000.0
    _unacked(client, "a", GENERATE_TASK, now - MARGIN_S - 1)
    _unacked(client, "b", GENERATE_TASK, now - 0.1)
    assert orphaned_generate_messages(client, now=now) == ["a"]


def test_a_worker_that_has_not_beaten_since_a_reservation_protects_it(client):
    now = 1_000_000.0
    _unacked(client, "maybe-gpu-1s", GENERATE_TASK, now - 10)
    _beat(client, "gpu-1", now - 9, [])  # beat after the reservation, but within the margin of it
    assert orphaned_generate_messages(client, now=now) == []
