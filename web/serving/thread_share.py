"""Which whole request a free API thread takes next: threads shared between keys.

A synchronous call (``POST /v1/generate``, SGLang's ``/generate``, a completion without
``stream``) holds its thread until its job ends. Handed to threads in arrival order, one key's
few hundred such calls (what slime keeps open) took every thread of the API, and every other key,
``/healthz`` and the admin's calls waited behind them. The event loop (``web/serving/request_buffering.py``)
now holds each whole request until this share gives it a thread: one key holds at most
``per_key`` threads at once (its other requests wait in the loop, a socket each), and a thread
that frees goes to the waiting key that holds the fewest (arrival order within a key). With no
keys configured (the open demo) one key has every thread.

A request's key is the configured key it presents, read by ``web/bearer.py`` as the app reads it;
a request presenting no configured key (none, an unknown one, a malformed header) waits with the
others that present none: a key made up per request is not a share of its own. ``/healthz`` and
``/metrics`` run on a small pool of their own (:data:`OPS_THREADS`), and so do an admin key's
control calls (weights, pausing: :data:`CONTROL_PATHS`, :data:`CONTROL_THREADS`); an admin key's
generation and waits are its share's like any key's. Were they on the control threads, six of an
admin's synchronous calls during a pause held them, and the admin's own ``/continue_generation``,
which those calls waited for, waited behind them.

Written by hand: gunicorn's thread pool is first come, first served and has no notion of a key.
"""

from __future__ import annotations

import enum
import hashlib
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from web.bearer import bearer_token

OPS_THREADS = 2
OPS_PATHS = frozenset({"/healthz", "/metrics"})
CONTROL_THREADS = 4  # an update waits for the fleet: two at once still leave pause and continue theirs
# The admin routes that steer the fleet (web/api/weights.py, web/dialects/vllm/views.py and
# web/dialects/sglang/views.py): none of them waits on a job.
CONTROL_PATHS = frozenset({"/v1/weights", "/update_weights_from_disk", "/pause_generation", "/continue_generation",
                           "/pause", "/resume", "/flush_cache"})


class Lane(enum.Enum):
    OPS = "ops"  # /healthz, /metrics
    CONTROL = "control"  # an admin key's control routes
    SHARE = "share"  # everything else, in its key's share


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


def key_digest(key: str) -> bytes:
    """What a key is known by here: its digest (the loop keeps no key in the clear)."""
    return hashlib.sha256(key.encode()).digest()


def digests(keys: Iterable[str]) -> frozenset[bytes]:
    return frozenset(map(key_digest, keys))


def request_key(authorization: str | None, known: frozenset[bytes]) -> bytes:
    """The share a request waits in: the digest of the configured key it presents, else ``b""``."""
    token = bearer_token(authorization)
    digest = key_digest(token) if token is not None else b""
    return digest if digest in known else b""


def lane(path: str, admin: bool) -> Lane:
    """Where a request runs: ``path`` as the app routes it (gunicorn's PATH_INFO); ``admin``: it
    presents an admin key, or the API is open (no keys: anyone may steer the fleet)."""
    if path in OPS_PATHS:
        return Lane.OPS
    if admin and path in CONTROL_PATHS:
        return Lane.CONTROL
    return Lane.SHARE
