"""A request's media parts, gathered for the pipeline (:mod:`processors.pipeline`): each one served
by the multimodal cache (by the caller's ``uuid``, or by the sha256 of its bytes), or fetched
through the guarded fetcher and decoded. The parts the cache does not serve are fetched at once
(at most ``fetch_concurrency`` at a time), all within one deadline for the whole request: a
request's media cost at most that long however many parts it has, and the first part that fails
stops the others."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError, MediaError
from engine.limits import MediaLimits
from engine.request_rules import check_media_count
from processors.base import Features, MultimodalProcessor
from processors.cache import MultimodalCache
from processors.decode import VideoSampling, decode_audio, decode_image, decode_video
from processors.errors import UnsupportedModalityError

PART_MODALITY = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


@dataclass
class Media:
    part: int
    modality: str
    url: str | None = None
    cache_key: str | None = None
    features: Features | None = None  # one item: from the cache or precomputed
    content_hash: str = ""  # known when the features came from the cache
    decoded: Any = None  # decoded (image, video or audio), still to process
    cached: bool = False


def video_sampling(media: MediaLimits) -> VideoSampling:
    """How a request's videos are sampled: its media limits' caps and frame rate."""
    return VideoSampling(max_seconds=media.max_video_seconds, max_frames=media.max_video_frames,
                         fps=media.video_fps, max_pixels=media.max_video_pixels)


class MediaGather:
    """One request's gathering; ``timings`` (fetch, decode, cache seconds) is the request's own
    dict, which this adds to. Closed by :meth:`close` (its shared deadline)."""

    def __init__(self, processor: MultimodalProcessor, fetcher, cache: MultimodalCache | None, media: MediaLimits,
                 options: dict[str, Any], owner: str | None, timings: dict[str, float]):
        self.processor, self.fetcher, self.cache, self.media = processor, fetcher, cache, media
        self.video = video_sampling(media)
        self.options, self.owner, self.timings = options, owner, timings
        self.cache_hits = 0
        self._deadline = None  # the request's one media budget, started by its first fetch

    def close(self, *exc_info: object) -> None:
        if self._deadline is not None:
            self._deadline.__exit__(*exc_info)

    def collect(self, parts: Sequence[Mapping[str, Any]]) -> list[Media]:
        check_media_count(len(parts), self.media.max_items)
        media = []
        for i, part in enumerate(parts):
            modality = PART_MODALITY.get(part.get("type"))
            if modality is None:
                raise InvalidRequestError(f"content_parts[{i}]: unknown type {part.get('type')!r}")
            if modality not in self.processor.modalities:
                raise UnsupportedModalityError(
                    f"content_parts[{i}]: this model takes {', '.join(sorted(self.processor.modalities))}, "
                    f"not {modality}"
                )
            media.append(Media(part=i, modality=modality, url=part["url"]))
        for item, part in zip(media, parts, strict=True):
            if self.cache is not None and part.get("uuid") is not None and self.owner:
                item.cache_key = self._key(item.modality, uuid=str(part["uuid"]), owner=self.owner)
                self._lookup(item)  # a uuid hit skips fetching entirely
        missing = [item for item in media if not item.cached]
        for item, data in zip(missing, self.fetch_all(missing), strict=True):
            self._load(item, data)
        return media

    def _load(self, item: Media, data: bytes) -> None:
        """Decode ``item``'s fetched bytes, unless their sha256 hits the cache."""
        if self.cache is not None and item.cache_key is None:
            item.cache_key = self._key(item.modality, media_sha256=hashlib.sha256(data).hexdigest())
            if self._lookup(item):
                return
        self.decode(item, data)

    def fetch_all(self, items: list[Media]) -> list[bytes]:
        """The bytes of every item, fetched at once (bounded), in order. The first failure ends
        the request's media budget, so the fetches still running stop instead of finishing."""
        if len(items) <= 1:
            return [self._fetch(item) for item in items]
        started = time.perf_counter()
        deadline = self._media_deadline()
        # Threads: fetching waits on sockets, and each fetch stays under the shared deadline.
        with ThreadPoolExecutor(max_workers=min(self.media.fetch_concurrency, len(items)),
                                thread_name_prefix="media-fetch") as pool:
            futures = [pool.submit(self._fetch_one, item) for item in items]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f in done and f.exception() is not None]
            if failed:
                deadline.expire()
                for future in futures:
                    future.cancel()
        self.timings["fetch"] += time.perf_counter() - started
        if failed:
            raise failed[0].exception()
        return [future.result() for future in futures]

    def _fetch(self, item: Media) -> bytes:
        started = time.perf_counter()
        try:
            return self._fetch_one(item)
        finally:
            self.timings["fetch"] += time.perf_counter() - started

    def _fetch_one(self, item: Media) -> bytes:
        try:
            return self.fetcher.fetch(item.url, deadline=self._media_deadline()).data
        except MediaError as exc:
            at_part(exc, item.part)
            raise

    def _media_deadline(self):
        """The one deadline all of this request's fetches share, started on first use."""
        if self._deadline is None:
            self._deadline = self.fetcher.deadline().__enter__()
        return self._deadline

    def decode(self, item: Media, data: bytes) -> None:
        started = time.perf_counter()
        try:
            item.decoded = self._decoder(item.modality)(data)
            if item.modality == "image":
                self.processor.check_image(item.decoded)
        except MediaError as exc:
            at_part(exc, item.part)
            raise
        finally:
            self.timings["decode"] += time.perf_counter() - started

    def _decoder(self, modality: str):
        media, video = self.media, self.video
        if modality == "video":
            return lambda data: decode_video(data, video)
        if modality == "audio":
            rate = self.processor.audio_sample_rate
            return lambda data: decode_audio(data, max_seconds=media.max_audio_seconds, sample_rate=rate)
        return lambda data: decode_image(data, max_pixels=media.max_image_pixels)

    def _key(self, modality: str, **source: str) -> str:
        options = self.options
        if modality == "video":  # the frames sampled depend on these too
            options = {**options, "_video": [self.video.fps, self.video.max_frames]}
        return MultimodalCache.key(model_id=self.processor.model_id, modality=modality, options=options, **source)

    def _lookup(self, item: Media) -> bool:
        started = time.perf_counter()
        entry = self.cache.get(item.cache_key)
        self.timings["cache"] += time.perf_counter() - started
        if entry is not None:
            item.features, item.content_hash = entry.features, entry.content_hash
        item.cached = entry is not None
        self.cache_hits += item.cached
        return item.cached


def at_part(exc: MediaError, part: int) -> None:
    """Name the content part in ``exc``'s message and errors; the caller re-raises it (same
    object: its type, fields and cause stay as the fetcher made them)."""
    exc.message = f"content_parts[{part}]: {exc.message}"
    exc.args = (exc.message, *exc.args[1:])
    if exc.errors is None or isinstance(exc.errors, dict):
        exc.errors = {**(exc.errors or {}), "part": part}
