"""One XREAD for every job event stream a process follows.

Each SSE stream used to block in an XREAD of its own, so N open streams cost N reads (and N
replies) per flush of tokens: the largest cost of the API process under the streaming benchmark
(``bench/README.md``). The hub's one thread reads every followed stream in one XREAD and hands
each reader (a :class:`Subscription`) its entries through a queue. A reader that joins wakes the
read at once (an entry on the process's own wake stream, which every read includes), so it waits
no longer than with a read of its own. Positions are kept per reader: two readers of one job,
from different places, each get their own entries.

When Redis is away, every reader is told (an :class:`Outage` item) and the thread tries again
every half second from where it was: a reader that rides the outage out loses nothing.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import redis

from domain.infra.redis_records import plausible_id
from domain.jobs.events import JobEvent, JobEvents, events_key, parse_event

log = logging.getLogger(__name__)

READ_COUNT = 512  # entries per stream per read, as JobEvents.read
RETRY_SECONDS = 0.5
WAKE_TTL_SECONDS = 3600


@dataclass(frozen=True)
class Outage:
    error: redis.RedisError


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    """One reader's jobs and positions; :meth:`get` its next entries."""

    def __init__(self, hub: EventHub, positions: dict[str, str]):
        self._hub = hub
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # job id -> the last entry delivered; written under the hub's lock
        self.at = {job_id: after for job_id, after in positions.items() if plausible_id(job_id)}

    def get(self, timeout: float) -> list[tuple[str, JobEvent]] | Outage | None:
        """The entries delivered since the last call, waiting up to ``timeout`` seconds for the first
        (None: nothing came); an :class:`Outage` when the last read failed."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, Outage):
            return item
        entries = list(item)
        while True:  # what else is queued already: one batch for the reader
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                return entries
            if isinstance(more, Outage):
                return entries  # the outage is over if entries came after it
            entries += more

    def drop(self, job_id: str) -> None:
        """Stop reading this job (it ended for this reader)."""
        self._hub.drop(self, job_id)

    def close(self) -> None:
        self._hub.unsubscribe(self)

    def deliver(self, item) -> None:
        self._queue.put(item)


class EventHub:
    def __init__(self, events: JobEvents, *, block_ms: int = 5000):
        self.events = events
        self.block_ms = block_ms
        self._lock = threading.Lock()
        self._someone = threading.Condition(self._lock)
        self._readers: dict[str, set[Subscription]] = {}  # job id -> its subscriptions
        self._wake_key = f"rq:hub:{uuid.uuid4().hex}:wake"
        self._wake_at = "0"
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._closed = False

    def subscribe(self, positions: dict[str, str]) -> Subscription:
        """A reader of these jobs from these positions (``"0"``: from the start). Raises RedisError
        when Redis is away (nothing is subscribed then)."""
        subscription = Subscription(self, positions)
        with self._lock:
            self._start_once()
            for job_id in subscription.at:
                self._readers.setdefault(job_id, set()).add(subscription)
            self._someone.notify()
        try:
            self._wake()  # the read in progress does not include it: end that read now
        except redis.RedisError:
            self.unsubscribe(subscription)
            raise
        return subscription

    def close(self) -> None:
        """Stop the thread (after its read in progress) and every subscription with it."""
        with self._lock:
            self._closed = True
            self._readers.clear()
            self._someone.notify()
        try:
            self._wake()
        except redis.RedisError:
            pass  # the read in progress fails or times out by itself

    def drop(self, subscription: Subscription, job_id: str) -> None:
        with self._lock:
            subscription.at.pop(job_id, None)
            self._forget(subscription, job_id)

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            for job_id in list(subscription.at):
                self._forget(subscription, job_id)
            subscription.at.clear()

    def _forget(self, subscription: Subscription, job_id: str) -> None:
        readers = self._readers.get(job_id)
        if readers is not None:
            readers.discard(subscription)
            if not readers:
                del self._readers[job_id]

    def _wake(self) -> None:
        pipe = self.events.redis.pipeline(transaction=False)
        pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1, approximate=False)
        pipe.expire(self._wake_key, WAKE_TTL_SECONDS)
        pipe.execute()

    def _start_once(self) -> None:
        # Started on first use, and again in a forked child (gunicorn's workers): a thread does
        # not survive a fork.
        if self._thread is None or self._pid != os.getpid():
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="event-hub", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            streams = self._positions()
            if streams is None:
                return
            try:
                reply = self.events.redis.xread(streams, block=self.block_ms, count=READ_COUNT)
            except redis.RedisError as error:
                self._tell_all(Outage(error))
                time.sleep(RETRY_SECONDS)
                continue
            except Exception:  # never let the thread die: every stream of the process would hang
                log.exception("event hub: unexpected error while reading")
                time.sleep(RETRY_SECONDS)
                continue
            self._dispatch(reply or [])

    def _positions(self) -> dict[str, str] | None:
        """What the next read asks for: each followed job's stream after the earliest position any
        of its readers is at, and the wake stream; waits while nobody follows anything. None once
        the hub is closed."""
        with self._lock:
            while not self._readers and not self._closed:
                self._someone.wait()
            if self._closed:
                return None
            streams = {}
            for job_id, readers in self._readers.items():
                streams[events_key(job_id)] = min((reader.at[job_id] for reader in readers), key=_order)
        streams[self._wake_key] = self._wake_at
        return streams

    def _tell_all(self, item) -> None:
        with self._lock:
            subscriptions = {reader for readers in self._readers.values() for reader in readers}
        for subscription in subscriptions:
            subscription.deliver(item)

    def _dispatch(self, reply) -> None:
        by_job: dict[str, list[JobEvent]] = {}
        for key, entries in reply:
            key = key.decode() if isinstance(key, bytes) else key
            if key == self._wake_key:
                last = entries[-1][0]
                self._wake_at = last.decode() if isinstance(last, bytes) else last
            else:
                by_job[key.split(":")[2]] = [parse_event(entry_id, fields) for entry_id, fields in entries]
        out: dict[Subscription, list[tuple[str, JobEvent]]] = {}
        with self._lock:
            for job_id, events in by_job.items():
                for reader in self._readers.get(job_id, ()):
                    after = _order(reader.at[job_id])
                    fresh = [event for event in events if _order(event.id) > after]
                    if fresh:
                        reader.at[job_id] = fresh[-1].id
                        out.setdefault(reader, []).extend((job_id, event) for event in fresh)
        for reader, entries in out.items():
            reader.deliver(entries)
