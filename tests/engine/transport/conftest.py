"""Fixtures for the transport tests: a real Redis, and producer/consumer agent processes."""

from __future__ import annotations

import pytest
import redis
from transport_support import Agent

from domain.infra.transport_acks import RedisAckChannel
from engine.transport import close_consumer_mappings
from tests.conftest import db_url


@pytest.fixture(scope="session")
def rq_redis_url(redis_url):
    """The session's isolated Redis, on a database of the transport tests' own."""
    return db_url(redis_url, 7)


@pytest.fixture
def redis_client(rq_redis_url):
    client = redis.Redis.from_url(rq_redis_url)
    yield client
    client.close()


@pytest.fixture
def acks(redis_client):
    """The pools' acknowledgements on the real Redis channel the workers use."""
    return RedisAckChannel(redis_client)


@pytest.fixture(scope="session")
def agents(rq_redis_url, tmp_path_factory):
    """A producer and a consumer agent, started once (importing torch costs ~1.5 s each)."""
    log_dir = tmp_path_factory.mktemp("agents")
    producer = Agent(rq_redis_url, "producer", log_dir)
    consumer = Agent(rq_redis_url, "consumer", log_dir)
    try:
        producer.wait_ready()
        consumer.wait_ready()
        yield producer, consumer
    finally:
        for agent in (producer, consumer):  # both exit at once: interpreter teardown is slow
            agent.request_stop()
        for agent in (producer, consumer):
            agent.wait_stopped()


@pytest.fixture
def spawn_agent(rq_redis_url, tmp_path):
    """Start extra agents for one test (e.g. a producer to kill); stopped afterwards."""
    started: list[Agent] = []

    def spawn(name: str) -> Agent:
        agent = Agent(rq_redis_url, name, tmp_path)
        started.append(agent)
        return agent

    yield spawn
    for agent in started:
        agent.stop()


@pytest.fixture(autouse=True)
def _fresh_consumer_mappings():
    yield
    close_consumer_mappings()
