"""The feature transport's acknowledgements on Redis (domain/infra/transport_acks.py): ids posted
per pool come back to that pool's drain once each, in order, past a drain batch; the lists
expire; an outage is reported (False, None), never raised."""

from __future__ import annotations

import secrets

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from domain.infra.transport_acks import ACK_KEY_TTL_S, DRAIN_BATCH, RedisAckChannel, ack_key
from tests.conftest import db_url


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(db_url(redis_url, 7)) as client:  # the transport tests' database
        yield client


def _pool_id() -> str:
    return secrets.token_hex(6)  # as a pool names itself: nothing else shares its list


def test_ids_go_to_their_own_pool_once_each_in_order(client):
    channel, a, b = RedisAckChannel(client), _pool_id(), _pool_id()
    assert channel.send({a: ["a1", "a2"], b: ["b1"]})
    assert channel.send({a: ["a3"]})
    assert 0 < client.ttl(ack_key(a)) <= ACK_KEY_TTL_S  # a dead producer's list does not leak
    assert channel.drain(a) == ["a1", "a2", "a3"]
    assert channel.drain(a) == []  # taken once
    assert channel.drain(b) == ["b1"]


def test_a_drain_takes_more_than_one_batch(client):
    channel, pool = RedisAckChannel(client), _pool_id()
    ids = [f"{n:016x}" for n in range(2 * DRAIN_BATCH + 5)]
    assert channel.send({pool: ids})
    assert channel.drain(pool) == ids


def test_nothing_to_send_sends_nothing_and_discard_drops_the_list(client):
    channel, pool = RedisAckChannel(client), _pool_id()
    assert channel.send({}) and channel.send({pool: []}) and not client.exists(ack_key(pool))
    channel.send({pool: ["x"]})
    channel.discard(pool)
    assert not client.exists(ack_key(pool)) and channel.drain(pool) == []


def test_an_outage_is_reported_not_raised():
    # Nothing listens on port 1; no client retries.
    channel = RedisAckChannel(redis.Redis(port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)))
    assert channel.send({_pool_id(): ["x"]}) is False
    assert channel.drain(_pool_id()) is None
    channel.discard(_pool_id())  # logged only
