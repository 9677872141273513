"""The process's :class:`engine.limits.Limits`, built once from the settings and the model's
context: the API, the CPU worker's pipeline and the GPU worker's engine all hold this one."""

from __future__ import annotations

from domain.settings import Settings
from engine.capacity import SchedulerLimits
from engine.limits import Limits, MediaLimits
from engine.request_rules import context_limit


def build_limits(settings: Settings, model_context: int | None) -> Limits:
    s = settings
    return Limits(
        context_tokens=context_limit(s.max_model_len, model_context),
        default_max_tokens=s.default_max_tokens,
        max_metadata_bytes=s.max_metadata_bytes,
        max_result_bytes=s.max_result_bytes,
        media=MediaLimits(max_items=s.max_content_parts, max_image_pixels=s.max_image_pixels,
                          max_video_seconds=s.max_video_seconds, max_video_frames=s.max_video_frames,
                          video_fps=s.video_fps, max_video_pixels=s.max_video_pixels,
                          max_audio_seconds=s.max_audio_seconds, fetch_concurrency=s.fetch_concurrency),
        scheduler=SchedulerLimits(max_rows=s.batch_rows, kv_cache_tokens=s.kv_cache_tokens,
                                  kv_block_tokens=s.kv_block_tokens, prefill_chunk_tokens=s.prefill_chunk_tokens,
                                  join_ratio=s.join_ratio, join_wait_steps=s.join_wait_steps,
                                  prompt_cache_tokens=s.prompt_cache_tokens, prefix_caching=s.prefix_caching,
                                  encoder_cache_bytes=s.encoder_cache_bytes),
    )
