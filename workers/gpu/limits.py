"""The GPU worker's continuous-batch limits from the settings (torch-free: the API checks them too)."""

from __future__ import annotations

from engine.capacity import SchedulerLimits
from workers.settings import Settings


def scheduler_limits(settings: Settings):
    """The GPU worker's continuous-batch limits (also checked by the API at submit)."""
    return SchedulerLimits(max_rows=settings.batch_rows, kv_cache_tokens=settings.kv_cache_tokens,
                           kv_block_tokens=settings.kv_block_tokens,
                           prefill_chunk_tokens=settings.prefill_chunk_tokens,
                           join_ratio=settings.join_ratio, join_wait_steps=settings.join_wait_steps,
                           prompt_cache_tokens=settings.prompt_cache_tokens,
                           prefix_caching=settings.prefix_caching,
                           encoder_cache_bytes=settings.encoder_cache_bytes)
