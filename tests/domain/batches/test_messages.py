"""A batch's chunk messages (domain/batches/messages.send_chunks) against a real broker."""

from __future__ import annotations

import json

import pytest
import redis
from kombu.exceptions import OperationalError

from domain.batches.messages import send_chunks
from domain.infra.redis_server import EmbeddedRedis
from domain.names import BATCHES_QUEUE
from domain.settings import Settings
from workers.celery_app import create_celery


@pytest.fixture
def broker(tmp_path):
    server = EmbeddedRedis(tmp_path / "broker", persistent=False).start()
    yield server
    server.stop()


def test_each_chunk_gets_its_message_in_order(broker, tmp_path):
    send_chunks(create_celery(Settings(state_dir=tmp_path), broker.url), "batch_x", [0, 2, 5])
    with redis.Redis.from_url(broker.url) as client:
        queued = [json.loads(message)["headers"]["argsrepr"] for message in client.lrange(BATCHES_QUEUE, 0, -1)]
    assert list(reversed(queued)) == [repr(["batch_x", index]) for index in (0, 2, 5)]  # LPUSH: oldest at the tail


def test_messages_the_broker_refuses_raise_what_a_failed_publish_raises(broker, tmp_path):
    """The broker answers but refuses the writes (out of memory): the caller gets kombu's
    OperationalError, which the API answers as 503 and the intake discards its batch on."""
    with redis.Redis.from_url(broker.url) as client:
        client.config_set("maxmemory", 1)
        client.config_set("maxmemory-policy", "noeviction")
    with pytest.raises(OperationalError):
        send_chunks(create_celery(Settings(state_dir=tmp_path), broker.url), "batch_x", [0, 1])
