"""One process's wiring, built from settings, each part on first use.

A Celery task is like a web view: it loads state by id, calls the real logic in ``processors/`` or
``engine/`` and stores a small result. What every process needs for that (the Redis client, the
stores, the Celery app, the model's facts, the limits) is this :class:`Runtime`; what one kind
of process needs besides is its subclass, which builds only that: the CPU worker's processor,
fetcher and feature transport, the GPU worker's engine and weight sync, the webhooks worker's
fetcher and signer (``workers/runtimes.py``), the API's services (``web/services.py``). So the
API never loads the model or the processor, and a webhooks worker no tokenizer.
"""

from __future__ import annotations

import logging
import threading
from functools import cached_property
from pathlib import Path

import redis

from domain.infra.redis_client import connect
from domain.infra.wakeups import WaitAny
from domain.jobs.events import JobEvents
from domain.jobs.store import JobStore, StoreLimits
from domain.limits import build_limits
from domain.models import model_id, resolve_model_path
from domain.settings import Settings
from engine.limits import Limits

log = logging.getLogger(__name__)


def multimodal_cache(settings: Settings, client: redis.Redis):
    """The multimodal cache the settings ask for, or None (``ROLLOUT_MM_CACHE_BYTES=0``)."""
    from processors.cache import MultimodalCache

    if not settings.mm_cache_bytes:
        return None
    return MultimodalCache(client, max_bytes=settings.mm_cache_bytes, local_max_bytes=settings.mm_cache_process_bytes)


class Runtime:
    """What every process uses: the Redis client and the stores, the Celery app, the model's facts
    and tokenizer, the limits, the key shares. Each worker kind's own parts are in its subclass
    (``workers/runtimes.py``); the API's in ``web/services.py``."""

    def __init__(self, settings: Settings, redis_url: str, celery=None):
        self.settings = settings
        self.redis_url = redis_url
        if celery is not None:
            self.celery = celery  # a worker's own app; the API's is built on first use
        self._shares: dict = {}

    @cached_property
    def celery(self):
        from workers.celery_app import create_celery

        return create_celery(self.settings, self.redis_url)

    @cached_property
    def redis(self) -> redis.Redis:
        return connect(self.redis_url)

    @cached_property
    def _hooked_owners(self) -> frozenset[str]:
        """The owners with a key-wide webhook: every end of their jobs and batches owes an event."""
        return frozenset(owner for owner, url in self.settings.key_webhooks.items() if url)

    @property
    def wait_any(self) -> WaitAny | None:
        """How this process's stores wait for a record's end: None, a BLPOP of their own per wait
        (an API process shares one for all: web/services.py)."""
        return None

    @cached_property
    def jobs(self) -> JobStore:
        s = self.settings
        return JobStore(self.redis, StoreLimits(s.max_queued_per_key, s.max_queued_total, s.result_ttl,
                                           s.stream_events_maxlen),
                        hooked_owners=self._hooked_owners, wait_any=self.wait_any)

    @cached_property
    def batches(self):
        from domain.batches.store import BatchStore

        return BatchStore(self.redis, result_ttl=self.settings.result_ttl, hooked_owners=self._hooked_owners,
                          wait_any=self.wait_any)

    @cached_property
    def files(self):
        from domain.batches.files import FileStore

        return FileStore(self.redis, ttl=self.settings.result_ttl)

    @cached_property
    def weight_store(self):
        """The fleet's weight target and each worker's report (domain/weights/store.py)."""
        from domain.weights.store import WeightStore

        return WeightStore(self.redis)

    @cached_property
    def events(self) -> JobEvents:
        return JobEvents(self.redis, ttl=self.settings.result_ttl, maxlen=self.settings.stream_events_maxlen)

    @cached_property
    def webhooks(self):
        """Webhook events and their attempts in Redis."""
        from domain.webhooks import WebhookStore

        return WebhookStore(self.redis, self.settings.result_ttl)

    @cached_property
    def model_path(self) -> str:
        return resolve_model_path(self.settings)

    @cached_property
    def model_probe(self):
        """The model's facts and tokenizer class, read without torch where this process has none."""
        from domain.model_probe import probe

        return probe(self.model_path, cache_dir=Path(self.settings.state_dir) / "model-probes")

    @property
    def model_facts(self):
        return self.model_probe.facts

    @cached_property
    def model_id(self) -> str:
        return model_id(self.settings)

    @cached_property
    def tokenizer(self):
        """The model's tokenizer alone (the API decodes and counts tokens with it; no processor)."""
        from domain.model_probe import load_tokenizer

        return load_tokenizer(self.model_path, self.model_probe.tokenizer_class)

    @cached_property
    def mm_cache(self):
        return multimodal_cache(self.settings, self.redis)

    @cached_property
    def limits(self) -> Limits:
        """Every limit a request meets here, built once (engine/limits.py): the API checks it, the
        CPU worker's pipeline and the GPU worker's engine take it."""
        return build_limits(self.settings, self.model_facts.context_tokens)

    def share(self, kind: str):
        """The per-key slot limit for ``kind`` (``cpu``: jobs and renders; ``webhooks``: attempts)."""
        from domain.infra.fair_share import KeyShare

        if kind not in self._shares:
            s = self.settings
            per_key, lease = {
                # No task outlives its hard time limit; an attempt no more than its deadline.
                "cpu": (s.cpu_key_slots, s.task_time_limit + 30),
                "webhooks": (s.webhook_per_key, s.webhook_timeout + 30),
            }[kind]
            self._shares[kind] = KeyShare(self.redis, kind, per_key=per_key, lease_s=lease)
        return self._shares[kind]

    def publish(self, task: str, args: list, kwargs: dict, queue: str) -> None:
        """Send a task message (how a share wakes a parked one)."""
        self.celery.send_task(task, args=args, kwargs=kwargs, queue=queue)

_building = threading.Lock()


def runtime(app) -> Runtime:
    """The runtime of ``app`` (a worker's Celery app), built on first use and kept on the app: of
    the class its worker kind set (``app.rollout_runtime_class``, workers/worker_kinds.py)."""
    with _building:  # a threads pool's first tasks may ask at once
        if getattr(app, "rollout_runtime", None) is None:
            app.rollout_runtime = _runtime_class(app)(app.rollout_settings, app.rollout_redis_url, app)
        return app.rollout_runtime


def fresh_runtime(app) -> Runtime:
    """Give ``app`` a new runtime: a forked pool process calls this first (Celery's
    ``worker_process_init``), because its parent's sockets, threads and transport memory are not
    its own."""
    global _building
    _building = threading.Lock()  # the parent's may have been held by another thread at the fork
    app.rollout_runtime = _runtime_class(app)(app.rollout_settings, app.rollout_redis_url, app)
    return app.rollout_runtime


def _runtime_class(app) -> type[Runtime]:
    return getattr(app, "rollout_runtime_class", Runtime)
