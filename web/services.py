"""What the views need: the process's runtime (``workers/runtime.py``, the same wiring every worker
uses) plus what only the API serves. Built once per app and kept in ``app.extensions``.

The API needs the model's config and its tokenizer, never the model or the processor: media are
fetched and rendered by CPU workers (web/api/render.py), tokens made by GPU workers. Both are read
without importing torch (``domain/model_probe.py``), so an API process starts light.
"""

from __future__ import annotations

from functools import cached_property

from flask import current_app

from domain.infra.redis_client import connect, with_pool_size
from domain.infra.redis_memory import MemoryGauge
from domain.infra.redis_reservations import Reservations
from domain.infra.wakeup_hub import WakeupHub
from domain.infra.wakeups import WaitAny
from domain.jobs.event_hub import EventHub
from domain.jobs.events import JobEvents
from domain.jobs.idempotency import IdempotencyStore
from domain.settings import Settings
from web.auth import KeyRing
from web.serving.thread_share import CONTROL_THREADS, OPS_THREADS
from web.serving.wait_slots import WaitSlots
from workers.runtime import Runtime


class Services(Runtime):
    def __init__(self, settings: Settings, redis_url: str):
        super().__init__(settings, redis_url)
        self.keys = KeyRing(settings.api_keys, settings.admin_keys)
        _ = self.model_facts  # a bad ROLLOUT_MODEL fails the API at start, not its first request

    @cached_property
    def redis(self):
        """The process's shared client, its pool as large as the process's threads (plus a few for
        the hubs' own short calls): each thread may be in a call at once. redis-py's pool holds 100
        by default: 300 of one key's synchronous calls resuming together found it empty, and 57
        answered 503."""
        s = self.settings
        threads = s.api_threads + s.api_stream_slots + OPS_THREADS + CONTROL_THREADS
        return with_pool_size(connect(self.redis_url), threads + 16)

    @cached_property
    def stream_slots(self):
        from web.api.streams import StreamSlots

        s = self.settings
        per_key = s.api_stream_slots_per_key or max(1, s.api_stream_slots * 3 // 4)
        return StreamSlots(s.api_stream_slots, per_key)

    @cached_property
    def events(self) -> JobEvents:
        # The hub's read blocks one connection; streams make their own short calls (marks, the
        # record of a job that ended) at once: a pool sized for the stream slots.
        client = with_pool_size(self.redis, self.settings.api_stream_slots + 16)
        return JobEvents(client, ttl=self.settings.result_ttl, maxlen=self.settings.stream_events_maxlen)

    @cached_property
    def idempotency(self) -> IdempotencyStore:
        """Submits' Idempotency-Keys (web/api/idempotency.py), kept as long as the jobs' results."""
        return IdempotencyStore(self.redis, ttl=self.settings.result_ttl)

    @cached_property
    def redis_memory(self) -> MemoryGauge:
        """Redis' memory against its bound, read at most once a second (domain/infra/redis_memory.py):
        new work is refused at its high-water mark; /healthz and /metrics show it."""
        return MemoryGauge(self.redis)

    @cached_property
    def reservations(self) -> Reservations:
        """What accepted jobs' results may still take, reserved at submit (domain/infra/redis_reservations.py)."""
        return Reservations(self.redis)

    @cached_property
    def wait_slots(self) -> WaitSlots:
        """Long polls per key in this process: at most half its request threads (web/api/long_poll.py)."""
        return WaitSlots(max(1, self.settings.api_threads // 2))

    @cached_property
    def wakeup_hub(self) -> WakeupHub:
        """One BLPOP for every wait this process holds (domain/infra/wakeup_hub.py), on three
        connections of its own: a long poll or a synchronous call costs no connection of the pool
        ``/healthz``, the admin's calls and other keys use."""
        return WakeupHub(with_pool_size(self.redis, 3))

    @property
    def wait_any(self) -> WaitAny:
        return self.wakeup_hub.wait_any

    @cached_property
    def event_hub(self) -> EventHub:
        """One XREAD for every stream this process serves (domain/jobs/event_hub.py)."""
        return EventHub(self.events)


def services() -> Services:
    # The app itself, not an attribute through its proxy: 0.26 against 1.66 µs here, on a path
    # that runs several times per request and per batch line.
    return current_app._get_current_object().extensions["rollout"]
