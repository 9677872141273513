"""One BLPOP for every wait an API process holds: a long poll or a synchronous call costs a thread,
not a Redis connection.

Each wait used to block in a BLPOP of its own (:func:`domain.infra.wakeups.wait_for_any`), holding
one of the API process's Redis connections for its whole wait: 300 synchronous calls of one key
took every connection of redis-py's pool, and ``/healthz``, other keys and the admin's calls
answered 503 until they ended (issue #47). Here one thread per process watches the wake-up lists
of every waiter in one BLPOP on a connection of its own, and sets the waiters' events; waiting
takes nothing the rest of the process shares, and a process holds three connections for all of
its waits whatever their number (its BLPOP, its push-backs, and the wakes of waiters that start
watching new lists, which one pending wake serves however many start at once). The pattern is the job event hub's (``domain/jobs/event_hub.py``).

A waiter that starts watching a list the BLPOP in progress does not cover ends that BLPOP at once
(an entry on the process's own wake list, always watched first), so it waits no longer than with
a BLPOP of its own. A popped wake-up is pushed back (the record's other waiters, in this process or
another, see it too), and its list leaves the watched set, so it is not popped again in a loop.
While Redis is away the thread tries again every half second; a waiter's own timeout ends its
wait, and its caller reads the record's state as it would after any timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence

import redis

from domain.infra import wakeups

log = logging.getLogger(__name__)

RETRY_SECONDS = 0.5


class WakeupHub:
    """``wait_any(keys, timeout)`` as :func:`domain.infra.wakeups.wait_for_any` answers it, for
    every thread of the process through one BLPOP (``client``: a connection pool of its own)."""

    def __init__(self, client: redis.Redis):
        self._client = client
        self._lock = threading.Lock()
        self._someone = threading.Condition(self._lock)
        self._waiters: dict[str, set[threading.Event]] = {}
        self._wake_key = f"rq:wakehub:{uuid.uuid4().hex}"
        self._wake_pending = False  # a wake is on its way to the BLPOP in progress
        self._pushing = threading.Lock()  # one wake at a time: the pool holds one connection for them
        self._thread: threading.Thread | None = None
        self._pid = 0

    def wait_any(self, keys: Sequence[str], timeout: float) -> bool:
        """Block until one of ``keys`` holds a wake-up (True) or ``timeout`` seconds pass (False)."""
        if timeout < wakeups.SHORTEST_WAIT_S:
            return False
        event = threading.Event()
        with self._lock:
            wake = any(key not in self._waiters for key in keys) and not self._wake_pending
            self._wake_pending = self._wake_pending or wake
            for key in keys:
                self._waiters.setdefault(key, set()).add(event)
            self._start_once()
            self._someone.notify()
        try:
            if wake:
                self._wake()  # the BLPOP in progress does not watch these lists: end it now
            return event.wait(timeout)
        finally:
            with self._lock:
                for key in keys:
                    if (events := self._waiters.get(key)) is not None:
                        events.discard(event)
                        if not events:
                            del self._waiters[key]

    @property
    def watched(self) -> int:
        """The wake-up lists watched now."""
        with self._lock:
            return len(self._waiters)

    def _wake(self) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.rpush(self._wake_key, "1")
        pipe.expire(self._wake_key, wakeups.TTL_S)
        try:
            with self._pushing:
                pipe.execute()
        except redis.RedisError:
            pass  # the thread's next BLPOP (at most LONGEST_BLOCK_S away) watches the new lists

    def _start_once(self) -> None:
        # Started on first use, and again in a forked child (gunicorn's workers): a thread does
        # not survive a fork.
        if self._thread is None or self._pid != os.getpid():
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="wakeup-hub", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiters:
                    self._someone.wait()
                keys = list(self._waiters)
                self._wake_pending = False  # this BLPOP watches every list registered so far
            try:
                popped = self._client.blpop([self._wake_key, *keys], timeout=wakeups.LONGEST_BLOCK_S)
            except redis.RedisError as error:
                with self._lock:
                    someone = bool(self._waiters)
                if someone:  # a BLPOP nobody waits on any more (the process is ending) fails quietly
                    log.warning("wake-up hub: Redis is away (%s); retrying", error)
                    time.sleep(RETRY_SECONDS)
                continue
            except Exception:  # never let the thread die: every wait of the process would run to its timeout
                log.exception("wake-up hub: unexpected error")
                time.sleep(RETRY_SECONDS)
                continue
            if popped is None:
                continue
            key, value = (part.decode() if isinstance(part, bytes) else part for part in popped)
            if key == self._wake_key:
                continue
            with self._lock:
                for event in self._waiters.pop(key, ()):
                    event.set()
            pipe = self._client.pipeline(transaction=False)
            pipe.rpush(key, value)
            pipe.expire(key, wakeups.TTL_S)
            try:
                pipe.execute()
            except redis.RedisError:
                pass  # the record's other waiters read its state at their timeout
