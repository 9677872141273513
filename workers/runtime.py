"""One process's wiring, built from settings, each part on first use: the API and every worker alike.

A Celery task is like a web view: it loads state by id, calls the real logic in ``processors/`` or
``engine/`` and stores a small result. What those calls need (the Redis client, the stores, the
Celery app, the guarded fetchers, the model's processor, the multimodal cache, the feature
transport, the model) lives in one :class:`Runtime` per process. The API's services
(``web/services.py``) are this runtime plus what only the API serves. A part is built only when
first used, so the API never loads the model or the processor.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import cached_property
from pathlib import Path

import redis

from engine.limits import Limits
from processors.fetch import FetchPolicy, GuardedFetcher
from workers.infra.redis_client import connect
from workers.infra.wakeups import WaitAny
from workers.jobs.events import JobEvents
from workers.jobs.store import JobStore, StoreLimits
from workers.limits import build_limits
from workers.models import model_id, resolve_model_path
from workers.settings import Settings

log = logging.getLogger(__name__)


def fetch_policy(settings: Settings) -> FetchPolicy:
    return FetchPolicy(
        allowed_domains=settings.allowed_media_domains,
        allow_networks=settings.outbound_allow_networks,
        allowed_ports=settings.outbound_allowed_ports,
        media_root=settings.media_root,
        max_bytes=settings.media_max_bytes,
        connect_timeout=settings.fetch_connect_timeout,
        total_timeout=settings.fetch_timeout,
        retries=settings.fetch_retries,
    )


def multimodal_cache(settings: Settings, client: redis.Redis):
    """The multimodal cache the settings ask for, or None (``ROLLOUT_MM_CACHE_BYTES=0``)."""
    from processors.cache import MultimodalCache

    if not settings.mm_cache_bytes:
        return None
    return MultimodalCache(client, max_bytes=settings.mm_cache_bytes, local_max_bytes=settings.mm_cache_process_bytes)


def _use_torch_threads(settings: Settings) -> None:
    # Set before a part that computes with torch is built (the processor, the model); two threads
    # on two cores can make generation ten times slower.
    import torch

    torch.set_num_threads(settings.torch_threads)


class Runtime:
    def __init__(self, settings: Settings, redis_url: str, celery=None):
        self.settings = settings
        self.redis_url = redis_url
        if celery is not None:
            self.celery = celery  # a worker's own app; the API's is built on first use
        self._model_ready = threading.Event()
        self._model_error: BaseException | None = None
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
        from workers.batches.store import BatchStore

        return BatchStore(self.redis, result_ttl=self.settings.result_ttl, hooked_owners=self._hooked_owners,
                          wait_any=self.wait_any)

    @cached_property
    def files(self):
        from workers.batches.files import FileStore

        return FileStore(self.redis, ttl=self.settings.result_ttl)

    @cached_property
    def weight_store(self):
        """The fleet's weight target and each worker's report (workers/weights/store.py)."""
        from workers.weights.store import WeightStore

        return WeightStore(self.redis)

    @cached_property
    def events(self) -> JobEvents:
        return JobEvents(self.redis, ttl=self.settings.result_ttl, maxlen=self.settings.stream_events_maxlen)

    @cached_property
    def fetcher(self) -> GuardedFetcher:
        return GuardedFetcher(fetch_policy(self.settings))

    @cached_property
    def webhooks(self):
        """Webhook events and their attempts in Redis."""
        from workers.webhooks import WebhookStore

        return WebhookStore(self.redis, self.settings.result_ttl)

    @cached_property
    def webhook_fetcher(self) -> GuardedFetcher:
        """The fetcher webhook attempts go through: its policy differs from ``fetcher``'s."""
        from workers.webhooks import webhook_policy

        return GuardedFetcher(webhook_policy(self.settings))

    @cached_property
    def webhook_signer(self):
        from workers.webhooks import Signer

        signer = Signer(self.settings.webhook_secrets)
        if not signer.signs:
            log.warning("no ROLLOUT_WEBHOOK_SECRETS set: webhooks are sent without a webhook-signature "
                        "header, and receivers cannot tell them from forgeries")
        return signer

    @cached_property
    def model_path(self) -> str:
        return resolve_model_path(self.settings)

    @cached_property
    def model_probe(self):
        """The model's facts and tokenizer class, read without torch where this process has none."""
        from workers.model_probe import probe

        return probe(self.model_path, cache_dir=Path(self.settings.state_dir) / "model-probes")

    @property
    def model_facts(self):
        return self.model_probe.facts

    @cached_property
    def model_id(self) -> str:
        return model_id(self.settings)

    @cached_property
    def processor(self):
        from processors.registry import load_processor

        _use_torch_threads(self.settings)
        return load_processor(self.model_path, model_id=self.model_id)

    @cached_property
    def tokenizer(self):
        """The model's tokenizer alone (the API decodes and counts tokens with it; no processor)."""
        from workers.model_probe import load_tokenizer

        return load_tokenizer(self.model_path, self.model_probe.tokenizer_class)

    @cached_property
    def mm_cache(self):
        return multimodal_cache(self.settings, self.redis)

    @cached_property
    def limits(self) -> Limits:
        """Every limit a request meets here, built once (engine/limits.py): the API checks it, the
        CPU worker's pipeline and the GPU worker's engine take it."""
        return build_limits(self.settings, self.model_facts.context_length)

    def share(self, kind: str):
        """The per-key slot limit for ``kind`` (``cpu``: jobs and renders; ``webhooks``: attempts)."""
        from workers.infra.fair_share import KeyShare

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

    @cached_property
    def transport_kind(self) -> str:
        """Which feature transport this process produces with: CUDA IPC with a GPU, else shm."""
        import torch

        from engine.transport import choose_transport

        return choose_transport(self.settings.transport, cuda_available=torch.cuda.is_available())

    @cached_property
    def transport(self):
        """The producer side of feature transport (CPU workers), of ``transport_kind``."""
        from engine.transport import make_transport

        return make_transport(self.transport_kind, client=self.redis, capacity_bytes=self.settings.shm_pool_bytes,
                              ack_timeout=self.settings.handle_ack_timeout)

    def load_model(self) -> None:
        """Load the model, check that it scores its own tokens as it generates them, and load the
        fleet's current weights: all before this worker takes work (``workers/worker_main.py``).
        A model that fails the check is recorded (``/healthz`` says why) and raises."""
        from workers.gpu.model_check import record_model_check

        try:
            engine = self.engine
            if self.settings.fidelity_check:
                from engine.fidelity import check_fidelity

                try:
                    report = check_fidelity(engine, tolerance=self.settings.fidelity_tolerance)
                except Exception as exc:
                    record_model_check(self.redis, self.model_id, exc)
                    raise
                record_model_check(self.redis, self.model_id, None, report.as_dict())
                log.info("fidelity check passed: %s", report.as_dict())
            # The fleet's current weights before any work (a worker that starts late or after a crash).
            self.weight_sync.start()
        except BaseException as exc:
            self._model_error = exc
            raise
        finally:
            self._model_ready.set()

    @cached_property
    def engine(self):
        from engine.generation import Engine
        from engine.loading import load_model

        s = self.settings
        _use_torch_threads(s)
        loaded = load_model(self.model_path, device=s.device, dtype=s.dtype, weight_version=s.weight_version)
        # The engine checks the same context limit as the API and the CPU worker.
        loaded.max_context_length = self.limits.context_tokens
        log.info("model %s loaded on %s (weight_version %s)", self.model_id, loaded.device, loaded.weight_version)
        return Engine(loaded, _pool_sized(self.limits.scheduler, s, loaded))

    @cached_property
    def weight_sync(self):
        """This GPU worker's side of fleet-wide weight updates (workers/weights/sync.py)."""
        from workers.weights.sync import WeightSync

        s = self.settings
        return WeightSync(self.weight_store, self.engine, worker=f"{s.node_id}-{os.getpid()}", node=s.node_id,
                          weights_root=s.weights_root, kept_root=Path(s.state_dir) / "weights-kept")

    @property
    def model_ready(self) -> bool:
        return self._model_ready.is_set() and self._model_error is None

    def wait_for_model(self):
        self._model_ready.wait()
        if self._model_error is not None:
            raise self._model_error
        return self.engine


_building = threading.Lock()


def runtime(app) -> Runtime:
    """The runtime of ``app`` (a worker's Celery app), built on first use and kept on the app."""
    with _building:  # a threads pool's first tasks may ask at once
        if getattr(app, "rollout_runtime", None) is None:
            app.rollout_runtime = Runtime(app.rollout_settings, app.rollout_redis_url, app)
        return app.rollout_runtime


def fresh_runtime(app) -> Runtime:
    """Give ``app`` a new runtime: a forked pool process calls this first (Celery's
    ``worker_process_init``), because its parent's sockets, threads and transport memory are not
    its own."""
    global _building
    _building = threading.Lock()  # the parent's may have been held by another thread at the fork
    app.rollout_runtime = Runtime(app.rollout_settings, app.rollout_redis_url, app)
    return app.rollout_runtime


def _pool_sized(limits, settings: Settings, loaded):
    """On CUDA with ROLLOUT_KV_CACHE_MEMORY_FRACTION, the KV pool takes that share of the device
    memory free after the model loaded, at most ROLLOUT_KV_CACHE_TOKENS (what the API accepts at
    submit; a request this worker's smaller pool cannot hold is refused by its engine's check)."""
    import dataclasses

    import torch

    fraction = settings.kv_cache_memory_fraction
    if not fraction or loaded.device.type != "cuda":
        return limits
    from engine.paged_kv import kv_tokens_for_memory

    free, _ = torch.cuda.mem_get_info(loaded.device)
    tokens = min(limits.kv_cache_tokens, kv_tokens_for_memory(loaded.model.config, loaded.dtype, free, fraction))
    log.info("KV pool: %d tokens (%.0f%% of %.1f GiB free)", tokens, 100 * fraction, free / 2**30)
    return dataclasses.replace(limits, kv_cache_tokens=max(tokens, limits.kv_block_tokens))
