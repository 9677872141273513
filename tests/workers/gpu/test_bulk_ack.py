"""Bulk acknowledgement (workers/gpu/bulk_ack.py) on kombu's real Redis transport: one round trip
settles every message as kombu's own ack would (out of the unacknowledged hash and index, out of
the prefetch window, marked acknowledged), and nothing acknowledged comes back."""

from __future__ import annotations

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from tests.conftest import empty_db_url
from workers.gpu.bulk_ack import acknowledge_messages

QUEUE = Queue("bulk-ack-test", Exchange("bulk-ack-test"), routing_key="bulk-ack-test")


@pytest.fixture
def url(redis_url):
    return empty_db_url(redis_url, 23)


def received(connection, count: int) -> list:
    messages = []
    consumer = Consumer(connection.default_channel, [QUEUE], callbacks=[lambda body, message: messages.append(message)],
                        no_ack=False)
    consumer.qos(prefetch_count=count + 2)
    with consumer:
        while len(messages) < count:
            connection.drain_events(timeout=5)
    return messages


def test_one_pipeline_settles_every_message_as_kombus_ack_does(url):
    client = redis.Redis.from_url(url)
    with Connection(url) as connection:
        producer = Producer(connection.default_channel, exchange=QUEUE.exchange, routing_key=QUEUE.routing_key)
        QUEUE(connection.default_channel).declare()
        for i in range(6):
            producer.publish({"n": i}, declare=[QUEUE])
        messages = received(connection, 6)
        qos = connection.default_channel.qos
        assert client.hlen("unacked") == 6 and client.zcard("unacked_index") == 6
        assert len(qos._delivered) == 6

        client.config_resetstat()
        acknowledge_messages(messages[:5])
        calls = {name: stats["calls"] for name, stats in client.info("commandstats").items()}
        # One pipeline, not a MULTI: Redis at its maxmemory refuses a MULTI's removals (celery_transport.py).
        assert calls["cmdstat_zrem"] == 5 and calls["cmdstat_hdel"] == 5 and "cmdstat_exec" not in calls
        assert all(message.acknowledged for message in messages[:5]) and not messages[5].acknowledged
        assert client.hlen("unacked") == 1 and client.zcard("unacked_index") == 1
        qos._flush()
        assert list(qos._delivered) == [messages[5].delivery_tag]  # their places in the prefetch window are free

        acknowledge_messages(messages)  # the acknowledged ones are left alone; the last is settled
        assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
    with Connection(url) as connection:  # a new consumer: nothing comes back
        QUEUE(connection.default_channel).declare()
        assert connection.default_channel.basic_get(QUEUE.name) is None
