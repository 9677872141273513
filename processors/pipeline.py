"""Preprocess one validated job request into what the engine takes: expanded prompt token ids
and finalized (wrapped) multimodal items.

    content_parts ─ cache by (owner, uuid) ─▶ fetch ─ cache by sha256 ─▶ decode ─▶ model processor
    features ──────── decode + validate (format below) ───────────────────┐  (one call per modality)
                                                                          ▼
    token_ids / prompt ─▶ placeholders expanded per item ─▶ finalize (hook → hash → wrap)

Media: the parts the cache does not serve are fetched at once (at most
``limits.media.fetch_concurrency`` at a time), all within one deadline for the whole request (the
fetcher's total timeout): a request's media cost at most that long however many parts it has,
and the first part that fails stops the others.

Placeholders: ``token_ids`` carry one collapsed placeholder per media item or its already expanded
run; ``prompt`` text may use ``<image>``/``<video>``/``<audio>`` sentinels or the model's native
forms. Items pair with placeholders per modality, in order (the second video part is the
second video placeholder). When a text prompt's placeholders do not pair up with the media, the
full HF processor over the raw prompt decides (the authoritative path); if that fails too, or for token prompts,
:class:`~engine.errors.PlaceholderMismatchError` (422) states both counts.

Precomputed ``features`` (instead of ``content_parts``) are decoded and checked by
:mod:`processors.features_codec`, which also documents their format.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from engine.errors import (
    InvalidRequestError,
    MediaError,
    PlaceholderMismatchError,
    check_token_ids,
)
from engine.items import MultimodalItem, placeholder_range
from engine.limits import Limits, MediaLimits
from engine.request_rules import check_context, check_media_count, check_prompt_input
from processors.base import Features, MultimodalProcessor
from processors.cache import MultimodalCache
from processors.decode import VideoSampling, decode_audio, decode_image, decode_video
from processors.errors import PlaceholderCountError, UnsupportedModalityError
from processors.features_codec import decode_features
from processors.fetch import MediaTooShortError
from processors.finalize import Wrapper, bundle_item, finalize
from processors.placeholders import expand_tokens

_PART_MODALITY = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


def video_sampling(media: MediaLimits) -> VideoSampling:
    """How a request's videos are sampled: its media limits' caps and frame rate."""
    return VideoSampling(max_seconds=media.max_video_seconds, max_frames=media.max_video_frames,
                         fps=media.video_fps, max_pixels=media.max_video_pixels)


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    items: list[MultimodalItem]  # finalized, features wrapped for transport, in prompt order
    placeholder_ranges: list[dict[str, Any]]  # [{"modality", "offset", "length"}]
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage
    cache_hits: int = 0


def preprocess(
    request: Mapping[str, Any],
    *,
    processor: MultimodalProcessor,
    fetcher: Any,
    cache: MultimodalCache | None,
    transport: Wrapper,
    limits: Limits,
    options: Mapping[str, Any] | None = None,
    owner: str | None = None,
    new_tokens: int = 0,
) -> ProcessedPrompt:
    """Preprocess a validated request (``token_ids`` or ``prompt``; ``content_parts`` or
    ``features``). ``fetcher`` has ``fetch(url) -> FetchedMedia``; ``options`` are image
    processor kwargs (part of the cache key). ``owner`` is the API key id the request belongs to:
    cache entries found by a part's ``uuid`` are its own (without an owner, uuids are not used for
    the cache; the bytes' sha256 still is). Fetch and decode errors keep their type and name the
    part (``content_parts[i]``). ``new_tokens``: what the request adds to the prompt (max_tokens, or
    a score job's completion), counted with the expanded prompt against the context limit."""
    with _Run(processor, fetcher, cache, limits, dict(options or {}), owner, new_tokens) as run:
        token_ids, bundles = run.layout(request, add_special_tokens=True)
    started = time.perf_counter()
    items = finalize(bundles, processor=processor, transport=transport, before_wrap=run.store)
    run.timings["finalize"] = time.perf_counter() - started
    return ProcessedPrompt(
        prompt_token_ids=token_ids,
        items=items,
        placeholder_ranges=[placeholder_range(item.modality, *item.offset) for item in items],
        timings=run.timings,
        cache_hits=run.cache_hits,
    )


@dataclass
class _Media:
    part: int
    modality: str
    url: str | None = None
    cache_key: str | None = None
    features: Features | None = None  # one item: from the cache or precomputed
    content_hash: str = ""  # known when the features came from the cache
    decoded: Any = None  # decoded (image, video or audio), still to process
    cached: bool = False


class _Run:
    """One request's way through the pipeline (state shared by the steps; not reused)."""

    def __init__(self, processor, fetcher, cache, limits: Limits, options: dict[str, Any],
                 owner: str | None = None, new_tokens: int = 0):
        self.new_tokens = new_tokens
        self.processor: MultimodalProcessor = processor
        self.owner = owner  # uuid cache entries are private to it (see processors.cache)
        self.fetcher = fetcher
        self.cache: MultimodalCache | None = cache
        self.limits, self.media = limits, limits.media
        self.video = video_sampling(limits.media)
        self.options = options
        self.timings = {"fetch": 0.0, "decode": 0.0, "cache": 0.0, "process": 0.0}
        self.cache_hits = 0
        self._deadline = None  # the request's one media budget, started by its first fetch

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._deadline is not None:
            self._deadline.__exit__(*exc_info)

    def layout(
        self, request: Mapping[str, Any], *, add_special_tokens: bool
    ) -> tuple[list[int], list[MultimodalItem]]:
        """Expanded token ids and unfinalized items (bundles) of ``request``."""
        check_prompt_input(request)
        has_tokens, has_features = request.get("token_ids") is not None, request.get("features") is not None
        if has_features:
            decoded = decode_features(request["features"], self.processor, max_items=self.media.max_items,
                                      max_bytes=self.media.max_feature_bytes)
            media = [_Media(part=i, modality="image", features=f) for i, f in enumerate(decoded)]
        else:
            media = self._collect(request.get("content_parts") or [])

        bundles = self._process(media)
        replacements = self._replacements(media, bundles)
        if has_tokens:
            token_ids = _checked_token_ids(request["token_ids"], len(self.processor.tokenizer))
            try:
                ids, offsets = self._expand(token_ids, replacements, media)
            except PlaceholderCountError as exc:
                raise _mismatch(exc.placeholders, exc.items, "token_ids", exc.detail) from None
        else:
            prompt = request["prompt"]
            text, count = self.processor.normalize_prompt(prompt)
            try:
                if count != len(media):
                    raise PlaceholderCountError(placeholders=count, items=len(media))
                encoded = self.processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
                ids, offsets = self._expand(encoded, replacements, media)
            except PlaceholderCountError:
                if expanded := self._expanded_run(text, len(media)):
                    raise expanded from None
                if has_features:  # no raw media for the HF processor to look at
                    raise _mismatch(count, len(media), "prompt") from None
                return self._authoritative(prompt, media, count, add_special_tokens)
        self._check_length(ids)
        return ids, self._bundles(media, bundles, offsets)

    def _expanded_run(self, text: str, items: int) -> PlaceholderMismatchError | None:
        """The error for a text prompt whose placeholders come already expanded (a rendered or
        decoded prompt: a run of pad tokens per item), which counts as no placeholder at all."""
        ids = self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        modality_of = self.processor.token_modality
        at = next((i for i in range(len(ids) - 1) if ids[i] in modality_of and ids[i + 1] == ids[i]), None)
        if at is None:
            return None
        end = at
        while end < len(ids) and ids[end] == ids[at]:
            end += 1
        modality = modality_of[ids[at]]
        pad = self.processor.tokenizer.convert_ids_to_tokens(ids[at])
        marks = " or ".join(dict.fromkeys([f"<{modality}>", self.processor.native_placeholder(modality)]))
        return PlaceholderMismatchError(
            f"prompt holds an expanded {modality} placeholder run ({end - at} x {pad} at token {at}): a text "
            f"prompt marks each media item once ({marks}); send already expanded ids as token_ids",
            placeholders=end - at, items=items)

    def _check_length(self, ids: list[int]) -> None:
        check_context(len(ids), self.new_tokens, self.limits.context_tokens,
                      prompt="prompt with its media placeholders expanded")

    def store(self, items: list[MultimodalItem]) -> None:
        """Put freshly processed per-image features into the cache (finalize's before_wrap)."""
        if self.cache is None:
            return
        started = time.perf_counter()
        for item in items:
            if item.metadata.get("cache_key") and not item.metadata.get("cached"):
                self.cache.put(item.metadata["cache_key"], item.features, item.content_hash)
        self.timings["cache"] += time.perf_counter() - started

    # --- media -------------------------------------------------------------------------------

    def _collect(self, parts: Sequence[Mapping[str, Any]]) -> list[_Media]:
        check_media_count(len(parts), self.media.max_items)
        media = []
        for i, part in enumerate(parts):
            modality = _PART_MODALITY.get(part.get("type"))
            if modality is None:
                raise InvalidRequestError(f"content_parts[{i}]: unknown type {part.get('type')!r}")
            if modality not in self.processor.modalities:
                raise UnsupportedModalityError(
                    f"content_parts[{i}]: this model takes {', '.join(sorted(self.processor.modalities))}, "
                    f"not {modality}"
                )
            media.append(_Media(part=i, modality=modality, url=part["url"]))
        for item, part in zip(media, parts, strict=True):
            if self.cache is not None and part.get("uuid") is not None and self.owner:
                item.cache_key = self._key(item.modality, uuid=str(part["uuid"]), owner=self.owner)
                self._lookup(item)  # a uuid hit skips fetching entirely
        missing = [item for item in media if not item.cached]
        for item, data in zip(missing, self._fetch_all(missing), strict=True):
            self._load(item, data)
        return media

    def _load(self, item: _Media, data: bytes) -> None:
        """Decode ``item``'s fetched bytes, unless their sha256 hits the cache."""
        if self.cache is not None and item.cache_key is None:
            item.cache_key = self._key(item.modality, media_sha256=hashlib.sha256(data).hexdigest())
            if self._lookup(item):
                return
        self._decode(item, data)

    def _fetch_all(self, items: list[_Media]) -> list[bytes]:
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

    def _fetch(self, item: _Media) -> bytes:
        started = time.perf_counter()
        try:
            return self._fetch_one(item)
        finally:
            self.timings["fetch"] += time.perf_counter() - started

    def _fetch_one(self, item: _Media) -> bytes:
        try:
            return self.fetcher.fetch(item.url, deadline=self._media_deadline()).data
        except MediaError as exc:
            _at_part(exc, item.part)
            raise

    def _media_deadline(self):
        """The one deadline all of this request's fetches share, started on first use."""
        if self._deadline is None:
            self._deadline = self.fetcher.deadline().__enter__()
        return self._deadline

    def _decode(self, item: _Media, data: bytes) -> None:
        started = time.perf_counter()
        try:
            item.decoded = self._decoder(item.modality)(data)
            if item.modality == "image":
                self.processor.check_image(item.decoded)
        except MediaError as exc:
            _at_part(exc, item.part)
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

    def _lookup(self, item: _Media) -> bool:
        started = time.perf_counter()
        entry = self.cache.get(item.cache_key)
        self.timings["cache"] += time.perf_counter() - started
        if entry is not None:
            item.features, item.content_hash = entry.features, entry.content_hash
        item.cached = entry is not None
        self.cache_hits += item.cached
        return item.cached

    def _process(self, media: list[_Media]) -> dict[str, Features]:
        """One bundle per modality of the freshly decoded items, in their order."""
        fresh: dict[str, list[Any]] = {}
        for item in media:
            if item.decoded is not None:
                fresh.setdefault(item.modality, []).append(item.decoded)
        if not fresh:
            return {}
        started = time.perf_counter()
        bundles = {modality: self.processor.process(modality, decoded, self.options)
                   for modality, decoded in fresh.items()}
        self.timings["process"] += time.perf_counter() - started
        return bundles

    # --- placeholders ------------------------------------------------------------------------

    def _replacements(self, media: list[_Media], bundles: dict[str, Features]) -> list[list[int]]:
        replacements, index = [], dict.fromkeys(bundles, 0)
        for item in media:
            if item.features is not None:
                run = self.processor.replacement(item.modality, item.features, 0)
            else:
                run = self.processor.replacement(item.modality, bundles[item.modality], index[item.modality])
                index[item.modality] += 1
            if item.modality != "image" and self.processor.token_id(item.modality) not in run:
                # The encoder makes no feature of it (Whisper-style audio under ~30 ms): say so, not
                # "placeholder mismatch".
                raise MediaTooShortError(f"content_parts[{item.part}]: the {item.modality} is too short for this "
                                         "model: its encoder makes no feature of it",
                                         errors={"part": item.part})
            replacements.append(run)
        return replacements

    def _expand(self, token_ids: Sequence[int], replacements: list[list[int]], media: list[_Media]):
        return expand_tokens(
            token_ids, replacements, placeholder_ids=self.processor.media_placeholder_ids,
            collapsed_id=[self.processor.token_id(item.modality) for item in media],
            modalities=[item.modality for item in media], token_modality=self.processor.token_modality,
        )

    def _bundles(self, media: list[_Media], bundles: dict[str, Features], offsets) -> list[MultimodalItem]:
        def meta(item: _Media) -> dict[str, Any]:
            known = {"content_hash": item.content_hash} if item.features is not None and item.content_hash else {}
            return {"part": item.part, "cache_key": item.cache_key, "cached": item.cached, **known}

        items = [
            bundle_item(item.modality, item.features, [offset], [meta(item)])
            for item, offset in zip(media, offsets, strict=True) if item.features is not None
        ]
        for modality, bundle in bundles.items():
            fresh = [(item, offset) for item, offset in zip(media, offsets, strict=True)
                     if item.features is None and item.modality == modality]
            items.append(bundle_item(modality, bundle, [o for _, o in fresh], [meta(item) for item, _ in fresh]))
        return items

    def _authoritative(
        self, prompt: str, media: list[_Media], counted: int, add_special_tokens: bool
    ) -> tuple[list[int], list[MultimodalItem]]:
        """The full HF processor over the raw prompt: the last word on where images go."""
        hf = self.processor.hf
        # Only images: the HF processors of other modalities need what this deployment lacks
        # (torchvision for video) or pair items differently; their prompts must line up.
        if any(item.modality != "image" for item in media) or prompt.count(hf.image_token) != len(media):
            raise _mismatch(counted, len(media), "prompt")
        unfetched = [item for item in media if item.decoded is None]  # cache hits: the HF processor needs pixels
        for item, data in zip(unfetched, self._fetch_all(unfetched), strict=True):
            self._decode(item, data)
            item.features, item.content_hash = None, ""  # now from the HF processor's bundle
        started = time.perf_counter()
        out = hf(text=[prompt], images=[m.decoded for m in media] or None, return_tensors="pt",
                 add_special_tokens=add_special_tokens, **self.options)
        self.timings["process"] += time.perf_counter() - started
        bundles = {"image": {name: out[name] for name in self.processor.feature_names}} if media else {}
        try:
            ids, offsets = self._expand(out["input_ids"][0].tolist(), self._replacements(media, bundles), media)
        except PlaceholderCountError as exc:
            raise _mismatch(counted, exc.items, "prompt", exc.detail) from None
        self._check_length(ids)
        return ids, self._bundles(media, bundles, offsets)


def _mismatch(placeholders: int, items: int, where: str, detail: str = "") -> PlaceholderMismatchError:
    return PlaceholderMismatchError(
        f"{where} has {placeholders} media placeholders for {items} media items"
        + (f" ({detail})" if detail else ""),
        placeholders=placeholders,
        items=items,
    )


def _at_part(exc: MediaError, part: int) -> None:
    """Name the content part in ``exc``'s message and errors; the caller re-raises it (same
    object: its type, fields and cause stay as the fetcher made them)."""
    exc.message = f"content_parts[{part}]: {exc.message}"
    exc.args = (exc.message, *exc.args[1:])
    if exc.errors is None or isinstance(exc.errors, dict):
        exc.errors = {**(exc.errors or {}), "part": part}


def _checked_token_ids(token_ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(token_ids, list) or not token_ids:
        raise InvalidRequestError("token_ids must be a non-empty list of integers")
    check_token_ids(token_ids, vocab_size, "token_ids")
    return token_ids


__all__ = ["ProcessedPrompt", "preprocess"]
