"""Every limit a request meets, in one object: built once per process from the settings and the
model (``domain/limits.py``), and handed to the API's checks, the preprocessing pipeline and the
engine, so each limit has one name and one value wherever it is checked.

Torch-free: the API holds one. The defaults are the settings' defaults (checked by
tests/domain/test_limits.py), so a part built without settings limits what the service would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.capacity import SchedulerLimits

MIB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """What one request's media may be (``ROLLOUT_MAX_*``): counted and decoded sizes, the video
    frames sampled from them, and how many parts are fetched at once."""

    max_items: int = 16  # content parts, or a features payload's entries
    max_image_pixels: int = 40_000_000  # decoded, before the processor resizes
    max_video_seconds: float = 600.0
    max_video_frames: int = 32
    video_fps: float = 2.0
    max_video_pixels: int = 1920 * 1088
    max_audio_seconds: float = 30.0
    max_feature_bytes: int = 256 * MIB  # all precomputed features of a request together
    fetch_concurrency: int = 4


@dataclass(frozen=True)
class Limits:
    # The context a prompt and its new tokens must fit (ROLLOUT_MAX_MODEL_LEN, never past the
    # model's own: engine.request_rules.context_limit); None: neither is known, no limit.
    context_tokens: int | None = None
    default_max_tokens: int = 64  # a request that names no max_tokens
    max_metadata_bytes: int = 4096
    max_result_bytes: int = 32 * MIB  # one job's result at the most (engine/result_bound.py)
    media: MediaLimits = field(default_factory=MediaLimits)
    scheduler: SchedulerLimits = field(default_factory=SchedulerLimits)  # the GPU worker's batch
