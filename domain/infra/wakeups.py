"""Waking the waiters of a record (a job, a batch) when it ends, without polling.

The script that ends the record also pushes one entry to the record's wake-up list (:data:`PUSH_LUA`),
so the end and the wake-up are one step. A waiter blocks on that list with BLPOP and puts the entry
back for the record's other waiters: one push wakes one BLPOP.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

TTL_S = 300  # how long an ended record's wake-up stays for late waiters
# A BLPOP timeout Redis does not round down to 0 (which blocks for ever): it reads whole milliseconds.
SHORTEST_WAIT_S = 0.002
# Each BLPOP short enough to stay well inside a client's socket timeout.
LONGEST_BLOCK_S = 5.0

# Lua, formatted with ``key`` (the wake-up list) and ``value``: run by the script that ends the record.
PUSH_LUA = """redis.call('RPUSH', {key}, {value})
redis.call('EXPIRE', {key}, """ + str(TTL_S) + ")"


# How a store blocks until one of some wake-up lists holds an entry: (keys, timeout) -> found.
# A worker's stores BLPOP themselves (wait_for_any); an API process's share one BLPOP for all its
# waits (domain/infra/wakeup_hub.py).
WaitAny = Callable[[list[str], float], bool]


def waiting_on(client: redis.Redis) -> WaitAny:
    """The wait of a process that blocks in a BLPOP of its own per wait, on ``client``."""
    return lambda keys, timeout: wait_for_any(client, keys, timeout)


def wait_for_wakeup(client: redis.Redis, key: str, timeout: float) -> bool:
    """Block until ``key`` holds a wake-up (True) or ``timeout`` seconds pass (False)."""
    return wait_for_any(client, [key], timeout)


def wait_for_any(client: redis.Redis, keys: list[str], timeout: float) -> bool:
    """Block until one of ``keys`` holds a wake-up (True) or ``timeout`` seconds pass (False): one
    BLPOP watches them all."""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) >= SHORTEST_WAIT_S:
        popped = client.blpop(keys, timeout=min(remaining, LONGEST_BLOCK_S))
        if popped is not None:
            key, value = popped
            pipe = client.pipeline()
            pipe.rpush(key, value)
            pipe.expire(key, TTL_S)
            pipe.execute()
            return True
    return False
