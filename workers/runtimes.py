"""Each worker kind's own parts on top of the shared :class:`workers.runtime.Runtime`, built on
first use: a worker of one kind never builds another kind's (``workers/worker_kinds.py`` names
the class each kind runs with)."""

from __future__ import annotations

import logging
import os
import threading
from functools import cached_property
from pathlib import Path

from domain.settings import Settings
from processors.fetch import FetchPolicy, GuardedFetcher
from workers.runtime import Runtime

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


def _use_torch_threads(settings: Settings) -> None:
    # Set before a part that computes with torch is built (the processor, the model); two threads
    # on two cores can make generation ten times slower.
    import torch

    torch.set_num_threads(settings.torch_threads)


class CpuRuntime(Runtime):
    """The CPU worker's: preprocessing (the model's processor, the guarded fetcher) and the
    producer side of feature transport. Renders run here too."""

    @cached_property
    def fetcher(self) -> GuardedFetcher:
        return GuardedFetcher(fetch_policy(self.settings))

    @cached_property
    def processor(self):
        from processors.registry import load_processor

        _use_torch_threads(self.settings)
        return load_processor(self.model_path, model_id=self.model_id)

    @cached_property
    def transport_kind(self) -> str:
        """Which feature transport this process produces with: CUDA IPC with a GPU, else shm."""
        import torch

        from engine.transport import choose_transport

        return choose_transport(self.settings.transport, cuda_available=torch.cuda.is_available())

    @cached_property
    def transport(self):
        """The producer side of feature transport (CPU workers), of ``transport_kind``."""
        from domain.infra.transport_acks import RedisAckChannel
        from engine.transport import make_transport

        return make_transport(self.transport_kind, acks=RedisAckChannel(self.redis),
                              capacity_bytes=self.settings.shm_pool_bytes, ack_timeout=self.settings.handle_ack_timeout)



class GpuRuntime(Runtime):
    """The GPU worker's: the model loaded and checked, its engine, and the fleet's weight sync."""

    def __init__(self, settings: Settings, redis_url: str, celery=None):
        super().__init__(settings, redis_url, celery)
        self._model_ready = threading.Event()
        self._model_error: BaseException | None = None

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
            self.adapter_sync.start()  # the fleet's adapters too (workers/gpu/adapter_sync.py)
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
        loaded.context_tokens = self.limits.context_tokens
        log.info("model %s loaded on %s (weight_version %s)", self.model_id, loaded.device, loaded.weight_version)
        return Engine(loaded, _pool_sized(self.limits.scheduler, s, loaded), max_loras=s.max_loras,
                      max_lora_rank=s.max_lora_rank, max_cpu_loras=s.max_cpu_loras)

    @cached_property
    def adapter_sync(self):
        """This GPU worker's side of the adapter registry (workers/gpu/adapter_sync.py)."""
        from domain.adapters.store import AdapterRegistry
        from workers.gpu.adapter_sync import AdapterSync

        s = self.settings
        return AdapterSync(AdapterRegistry(self.redis), self.engine, worker=f"{s.node_id}-{os.getpid()}",
                           weights_root=s.weights_root)

    @cached_property
    def weight_sync(self):
        """This GPU worker's side of fleet-wide weight updates (workers/gpu/weight_sync.py)."""
        from workers.gpu.weight_sync import WeightSync

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




class WebhooksRuntime(Runtime):
    """The webhooks worker's: the fetcher its attempts go through and the signer of its events."""

    @cached_property
    def webhook_fetcher(self) -> GuardedFetcher:
        """The fetcher webhook attempts go through: its policy differs from ``fetcher``'s."""
        from domain.webhooks import webhook_policy

        return GuardedFetcher(webhook_policy(self.settings))

    @cached_property
    def webhook_signer(self):
        from domain.webhooks import Signer

        signer = Signer(self.settings.webhook_secrets)
        if not signer.signs:
            log.warning("no ROLLOUT_WEBHOOK_SECRETS set: webhooks are sent without a webhook-signature "
                        "header, and receivers cannot tell them from forgeries")
        return signer



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
