"""The bulk-taking transport (workers/celery_transport.py) on a real Redis, beside kombu's own: one
wake-up fills the prefetch window in one script, every message recorded exactly as kombu records
it (so kombu's acks and restores read it), in kombu's order, and nothing held by nobody when a
callback fails or a message is not JSON."""

from __future__ import annotations

import json

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from domain.settings import Settings
from tests.conftest import empty_db_url
from workers import celery_transport
from workers.celery_app import create_celery

QUEUE = Queue("bulk-take-test", Exchange("bulk-take-test"), routing_key="bulk-take-test", max_priority=9)


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    # Its own server: the tests count commands in INFO commandstats, which is server-wide, and any
    # other client of the suite's shared server (a worker an earlier test left draining) counts there.
    from domain.infra.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-transport"), persistent=False).start()
    yield server
    server.stop()


@pytest.fixture
def url(private_redis):
    return empty_db_url(private_redis.url, 23)


@pytest.fixture
def client(url):
    client = redis.Redis.from_url(url)
    yield client
    client.close()


def publish(url: str, bodies: list, priorities: list[int] | None = None) -> None:
    with Connection(url) as connection:
        producer = Producer(connection.default_channel, exchange=QUEUE.exchange, routing_key=QUEUE.routing_key)
        QUEUE(connection.default_channel).declare()
        for index, body in enumerate(bodies):
            producer.publish(body, declare=[QUEUE], priority=priorities[index] if priorities else None)


def consume(connection, prefetch: int, wakeups: int, callback=None) -> list:
    """The messages ``wakeups`` polls deliver (a poll that finds nothing ends it)."""
    messages = []
    consumer = Consumer(connection.default_channel, [QUEUE], no_ack=False, accept=["json"],
                        callbacks=[callback or (lambda body, message: messages.append(message))])
    consumer.qos(prefetch_count=prefetch)
    with consumer:
        for _ in range(wakeups):
            try:
                connection.drain_events(timeout=0.5)
            except TimeoutError:
                break
    return messages


def test_one_wakeup_fills_the_prefetch_window_in_one_script(url, client):
    publish(url, [{"n": i} for i in range(8)])
    client.config_resetstat()
    with Connection(url, transport=celery_transport.Transport) as connection:
        messages = consume(connection, prefetch=5, wakeups=1)
        assert [m.payload["n"] for m in messages] == [0, 1, 2, 3, 4]
        calls = {name: stats["calls"] for name, stats in client.info("commandstats").items()}
        # One BRPOP and one script (kombu's restore sweep runs a transaction or two of its own).
        assert calls["cmdstat_brpop"] == 1 and calls["cmdstat_evalsha"] + calls.get("cmdstat_eval", 0) <= 2
        assert calls.get("cmdstat_exec", 0) < 5  # kombu's record, one transaction per message: not run
        assert client.hlen("unacked") == 5 and client.zcard("unacked_index") == 5
        assert client.llen(QUEUE.name) == 3  # the window is full: the rest wait in their queue
        for message in messages:
            message.ack()
        assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0


def test_records_are_kombus_own_and_kombus_restore_reads_them(url, client):
    publish(url, [{"n": 0}])
    with Connection(url) as connection:  # kombu's own transport: the record it writes
        [stock] = consume(connection, prefetch=5, wakeups=1)
        kombu_record = json.loads(client.hget("unacked", stock.delivery_tag))
        stock.ack()
    publish(url, [{"n": 0}, {"n": 1}])
    with Connection(url, transport=celery_transport.Transport) as connection:
        messages = consume(connection, prefetch=5, wakeups=1)
        records = [json.loads(client.hget("unacked", m.delivery_tag)) for m in messages]
        for record, message in zip(records, messages, strict=True):
            assert record[1:] == kombu_record[1:]  # exchange, routing key
            assert record[0].keys() == kombu_record[0].keys()
            assert record[0]["properties"]["delivery_tag"] == message.delivery_tag
        qos = connection.default_channel.qos
        qos.restore_by_tag(messages[1].delivery_tag)  # kombu's restore: back to the head of the queue
        messages[0].ack()
        assert client.hlen("unacked") == 0
    with Connection(url) as connection:
        [again] = consume(connection, prefetch=5, wakeups=1)
        assert again.payload == {"n": 1} and again.delivery_info["redelivered"]


def test_priorities_come_in_kombus_order(url, client):
    priorities = [0, 9, 3, 6, 0, 9, 3]
    publish(url, [{"n": i} for i in range(7)], priorities)
    with Connection(url) as connection:
        stock = [m.payload["n"] for m in consume(connection, prefetch=0, wakeups=20)]
    client.flushdb()
    publish(url, [{"n": i} for i in range(7)], priorities)
    with Connection(url, transport=celery_transport.Transport) as connection:
        ours = [m.payload["n"] for m in consume(connection, prefetch=0, wakeups=20)]
    assert ours == stock and len(ours) == 7


def test_a_failing_callback_sends_the_rest_back_to_the_head_of_their_queue(url, client):
    publish(url, [{"n": i} for i in range(6)])
    seen = []

    def callback(body, message):
        seen.append(body["n"])
        if body["n"] == 1:
            raise RuntimeError("the consumer failed")

    with Connection(url, transport=celery_transport.Transport) as connection:
        with pytest.raises(RuntimeError):
            consume(connection, prefetch=4, wakeups=1, callback=callback)
        assert seen == [0, 1]
        assert client.hlen("unacked") == 2  # the two delivered: their consumer holds them
        waiting = [json.loads(raw) for raw in reversed(client.lrange(QUEUE.name, 0, -1))]  # RPOP order
        assert [connection.default_channel.message_to_python(m).decode() for m in waiting] == [
            {"n": 2}, {"n": 3}, {"n": 4}, {"n": 5}]


def test_a_message_that_is_not_json_is_dropped_and_the_rest_are_recorded(url, client):
    publish(url, [{"n": 0}])
    client.lpush(QUEUE.name, b"{not json")
    publish(url, [{"n": 2}])
    with Connection(url, transport=celery_transport.Transport) as connection:
        messages = consume(connection, prefetch=5, wakeups=1)
        assert [m.payload["n"] for m in messages] == [0, 2]
        assert client.hlen("unacked") == 2 and client.llen(QUEUE.name) == 0


def test_an_unbounded_window_takes_at_most_a_bounded_number(url, client):
    publish(url, [{"n": i} for i in range(celery_transport.UNBOUNDED_TAKE + 10)])
    with Connection(url, transport=celery_transport.Transport) as connection:
        messages = consume(connection, prefetch=0, wakeups=1)
        assert len(messages) == celery_transport.UNBOUNDED_TAKE + 1  # BRPOP's own, and a take's worth


def test_a_channel_sends_through_one_client_until_its_pool_is_replaced(url, client):
    """kombu builds a redis.Redis per publish or ack; ours keeps one, bound to the channel's pool."""
    with Connection(url, transport=celery_transport.Transport) as connection:
        channel = connection.default_channel
        producer = Producer(channel, exchange=QUEUE.exchange, routing_key=QUEUE.routing_key)
        QUEUE(channel).declare()
        first = channel._create_client()
        for n in range(3):
            producer.publish({"n": n}, declare=[QUEUE])
        assert channel._create_client() is first and first.connection_pool is channel.pool
        assert channel._create_client(asynchronous=True) is not first  # the consumer's stays kombu's
        channel._disconnect_pools()  # what kombu does after a fork: a new pool, so a new client
        producer.publish({"n": 3}, declare=[QUEUE])
        again = channel._create_client()
        assert again is not first and again.connection_pool is channel.pool
        assert [m.payload["n"] for m in consume(connection, prefetch=0, wakeups=1)] == [0, 1, 2, 3]


@pytest.mark.parametrize("target", ["redis://127.0.0.1:6379/0", "redis+sentinel://127.0.0.1:26379/mymaster/0"])
def test_every_celery_app_takes_in_bulk(target):
    app = create_celery(Settings(), target)
    transport = app.connection_for_read().transport_cls
    assert transport in (celery_transport.Transport, celery_transport.SentinelTransport)
    assert issubclass(transport.Channel, celery_transport._BulkTake)
    assert (transport is celery_transport.SentinelTransport) == target.startswith("redis+sentinel")
