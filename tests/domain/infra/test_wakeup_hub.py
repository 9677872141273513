"""The API process's one BLPOP for all its waits (domain/infra/wakeup_hub.py), on a real Redis:
many waiters cost its few connections, each is woken by its own record's end and no other, a
record's other waiters still see the wake-up, and a timeout ends a wait."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from domain.infra import wakeups
from domain.infra.redis_client import with_pool_size
from domain.infra.wakeup_hub import WakeupHub
from tests.conftest import empty_db_url


@pytest.fixture
def client(redis_url):
    client = redis.Redis.from_url(empty_db_url(redis_url, 13))
    yield client
    client.flushdb()


def end(client, key: str) -> None:
    """What the script that ends a record does to its wake-up list."""
    client.eval(wakeups.PUSH_LUA.format(key="KEYS[1]", value="'1'"), 1, key)


def test_a_hundred_waiters_hold_three_connections_and_each_wakes_on_its_own_end(client):
    hub = WakeupHub(with_pool_size(client, 3))
    woken: dict[int, bool] = {}
    started = threading.Barrier(101)

    def wait(i: int) -> None:
        started.wait()
        woken[i] = hub.wait_any([f"rq:test:done:{i}", "rq:test:done:never"], 20)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(100)]
    for thread in threads:
        thread.start()
    started.wait()
    deadline = time.monotonic() + 10
    while hub.watched < 101 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hub.watched == 101
    for i in range(0, 100, 2):
        end(client, f"rq:test:done:{i}")
    for i in range(0, 100, 2):
        threads[i].join(10)
    assert all(woken.get(i) is True for i in range(0, 100, 2))
    assert not any(i in woken for i in range(1, 100, 2))  # the odd ones still wait
    assert hub._client.connection_pool._created_connections <= 3
    # A wake-up is put back: a later waiter of an ended record, here or in another process, sees it.
    assert hub.wait_any(["rq:test:done:0"], 5) is True
    assert wakeups.wait_for_any(client, ["rq:test:done:2"], 5) is True
    for i in range(1, 100, 2):
        end(client, f"rq:test:done:{i}")
    for thread in threads:
        thread.join(10)
    assert all(woken[i] for i in range(100))


def test_a_wait_with_nothing_ending_times_out(client):
    hub = WakeupHub(with_pool_size(client, 3))
    started = time.monotonic()
    assert hub.wait_any(["rq:test:done:none"], 0.3) is False
    assert time.monotonic() - started >= 0.3 and hub.watched == 0
    assert hub.wait_any(["rq:test:done:none"], 0) is False
