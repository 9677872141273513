"""Which whole request a free API thread takes next: threads shared between keys.

A synchronous call (``POST /v1/generate``, SGLang's ``/generate``, a completion without
``stream``) holds its thread until its job ends. Handed to threads in arrival order, one key's
few hundred such calls (what slime keeps open) took every thread of the API, and every other key,
``/healthz`` and the admin's calls waited behind them. The event loop (``web/serving/request_buffering.py``)
now holds each whole request until this share gives it a thread: one key holds at most
``per_key`` threads at once (its other requests wait in the loop, a socket each), and a thread
that frees goes to the waiting key that holds the fewest (arrival order within a key). With no
keys configured (the open demo) one key has every thread. ``/healthz``, ``/metrics`` and admin
keys' calls run on a small pool of their own (:data:`OPS_THREADS`) and never wait here.

Written by hand: gunicorn's thread pool is first come, first served and has no notion of a key.
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

OPS_THREADS = 2
OPS_PATHS = (b"/healthz", b"/metrics")


class ThreadShare:
    def __init__(self, threads: int, per_key: int):
        self.threads = threads
        self.per_key = max(1, min(per_key, threads))
        self._held: Counter = Counter()
        self._waiting: dict[bytes, deque] = {}
        self._running = 0

    def add(self, key: bytes, item: Any) -> None:
        self._waiting.setdefault(key, deque()).append(item)

    def take(self) -> tuple[bytes, Any] | None:
        """The next request to give a thread to, counted as running; None while every thread is
        taken or every waiting key holds its share."""
        if self._running >= self.threads:
            return None
        ready = [key for key in self._waiting if self._held[key] < self.per_key]
        if not ready:
            return None
        key = min(ready, key=lambda k: self._held[k])  # dicts keep insertion order: ties by arrival
        queue = self._waiting[key]
        item = queue.popleft()
        if not queue:
            del self._waiting[key]
        self._held[key] += 1
        self._running += 1
        return key, item

    def done(self, key: bytes) -> None:
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]
        self._running -= 1

    @property
    def waiting(self) -> int:
        return sum(map(len, self._waiting.values()))


def key_digest(bearer: bytes) -> bytes:
    """What a key is known by here: its digest (the loop keeps no key in the clear)."""
    return hashlib.sha256(bearer).digest() if bearer else b""


def digests(keys: Iterable[str]) -> frozenset[bytes]:
    return frozenset(key_digest(key.encode()) for key in keys)


def is_ops(target: bytes, key: bytes, admin_keys: frozenset[bytes]) -> bool:
    """``/healthz``, ``/metrics`` and an admin key's calls: the small pool of their own."""
    path = target.split(b"?", 1)[0]
    return path in OPS_PATHS or (bool(key) and key in admin_keys)
