"""Our Celery transport on a Redis at its maxmemory (noeviction refuses every write): acks land
(bulk and kombu's own), a message given back and refused leaves the prefetch window for the
held-message sweep, a message popped and refused a record is still delivered, and the window is
never left full: the wedge of issue #56, where refused acks stopped a GPU worker for good."""

from __future__ import annotations

import time

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from domain.infra.redis_server import EmbeddedRedis
from workers import celery_transport
from workers.gpu.bulk_ack import acknowledge_messages

QUEUE = Queue("maxmemory-test", Exchange("maxmemory-test"), routing_key="maxmemory-test")
BOUND = 4 * 1024 * 1024


@pytest.fixture
def server(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", persistent=False, maxmemory=BOUND).start()
    yield server
    server.stop()


@pytest.fixture
def client(server):
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


def fill(client: redis.Redis) -> None:
    """Write until Redis refuses even a small write."""
    index = 0
    for size in (10_000, 500, 20):
        try:
            while True:
                client.set(f"fill:{index}", "x" * size)
                index += 1
        except redis.exceptions.OutOfMemoryError:
            pass
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.lpush("probe", "x")


def free(client: redis.Redis) -> None:
    client.delete(*client.keys("fill:*"))


def publish(url: str, count: int) -> None:
    with Connection(url) as connection:
        producer = Producer(connection.default_channel, exchange=QUEUE.exchange, routing_key=QUEUE.routing_key)
        QUEUE(connection.default_channel).declare()
        for n in range(count):
            producer.publish({"n": n}, declare=[QUEUE])


def consume(connection, prefetch: int, before_drain=None) -> tuple[list, Consumer]:
    messages: list = []
    consumer = Consumer(connection.default_channel, [QUEUE], no_ack=False, accept=["json"],
                        callbacks=[lambda body, message: messages.append(message)])
    consumer.qos(prefetch_count=prefetch)
    consumer.consume()
    if before_drain is not None:
        before_drain()
    for _ in range(prefetch + 2):
        try:
            connection.drain_events(timeout=0.5)
        except TimeoutError:
            break
    return messages, consumer


def test_acks_land_at_the_bound_and_free_the_window(server, client):
    publish(server.url, 6)
    with Connection(server.url, transport=celery_transport.Transport) as connection:
        messages, _ = consume(connection, prefetch=6)
        assert len(messages) == 6
        qos = connection.default_channel.qos
        assert not qos.can_consume()  # the window is full
        fill(client)
        acknowledge_messages(messages[:5])  # the GPU session's bulk ack
        messages[5].ack()  # kombu's own, as Celery acknowledges a task
        assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
        assert qos.can_consume() and len(qos._delivered) - len(qos._dirty) == 0


def test_a_refused_requeue_leaves_the_message_to_the_held_message_sweep(server, client):
    publish(server.url, 2)
    with Connection(server.url, transport=celery_transport.Transport) as connection:
        messages, _ = consume(connection, prefetch=2)
        qos = connection.default_channel.qos
        fill(client)
        messages[0].reject(requeue=True)  # Redis refuses the LPUSH: no raise
        assert qos.can_consume()  # out of the window
        tag = messages[0].delivery_tag
        assert client.hget("unacked", tag) is not None  # still recorded: nothing lost
        free(client)
        qos.restore_by_tag(tag)  # what the sweep does once no live worker lists it
        assert client.llen(QUEUE.name) == 1 and client.hget("unacked", tag) is None


def test_a_message_popped_at_the_bound_is_delivered_not_lost(server, client):
    publish(server.url, 3)
    with Connection(server.url, transport=celery_transport.Transport) as connection:
        messages, _ = consume(connection, prefetch=3, before_drain=lambda: fill(client))
        # BRPOP pops (it writes nothing); recording it is refused: each runs unrecorded instead.
        assert sorted(m.payload["n"] for m in messages) == [0, 1, 2]
        assert client.llen(QUEUE.name) == 0
        for message in messages:
            message.ack()
        assert connection.default_channel.qos.can_consume()


def test_an_unrecorded_message_given_back_is_pushed_to_its_queue_once_redis_has_room(server, client):
    publish(server.url, 2)
    with Connection(server.url, transport=celery_transport.Transport) as connection:
        messages, _ = consume(connection, prefetch=2, before_drain=lambda: fill(client))
        assert len(messages) == 2 and client.hlen("unacked") == 0  # delivered, unrecorded
        fill(client)  # the pops freed a little
        for message in messages:
            message.reject(requeue=True)  # Redis refuses the push: held in this process
        assert connection.default_channel.qos.can_consume() and client.llen(QUEUE.name) == 0
        free(client)
        deadline = time.monotonic() + 10
        while client.llen(QUEUE.name) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.llen(QUEUE.name) == 2
    with Connection(server.url, transport=celery_transport.Transport) as connection:
        again, _ = consume(connection, prefetch=2)
        assert sorted(m.payload["n"] for m in again) == [0, 1]  # the very messages, whole
