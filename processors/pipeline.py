"""Preprocess one validated job request into what the engine takes: expanded prompt token ids
and finalized (wrapped) multimodal items.

    content_parts ─ cache by (owner, uuid) ─▶ fetch ─ cache by sha256 ─▶ decode ─▶ model processor
    features ──────── decode + validate (format below) ───────────────────┐  (one call per modality)
                                                                          ▼
    token_ids / prompt ─▶ placeholders expanded per item ─▶ finalize (hook → hash → wrap)

Media: gathered by :mod:`processors.media_gather` (the cache, else fetched at once within one
deadline for the whole request, then decoded).

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

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import (
    InvalidRequestError,
    PlaceholderMismatchError,
    check_token_ids,
)
from engine.items import MultimodalItem, placeholder_range
from engine.limits import Limits
from engine.request_rules import check_context, check_prompt_input
from processors.base import Features, MultimodalProcessor
from processors.cache import MultimodalCache
from processors.errors import PlaceholderCountError
from processors.features_codec import decode_features
from processors.fetch import MediaTooShortError
from processors.finalize import Wrapper, bundle_item, finalize
from processors.media_gather import Media, MediaGather
from processors.placeholders import expand_tokens


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
        cache_hits=run.gather.cache_hits,
    )


class _Run:
    """One request's way through the pipeline (state shared by the steps; not reused)."""

    def __init__(self, processor, fetcher, cache, limits: Limits, options: dict[str, Any],
                 owner: str | None = None, new_tokens: int = 0):
        self.new_tokens = new_tokens
        self.processor: MultimodalProcessor = processor
        self.owner = owner  # uuid cache entries are private to it (see processors.cache)
        self.cache: MultimodalCache | None = cache
        self.limits, self.media = limits, limits.media
        self.options = options
        self.timings = {"fetch": 0.0, "decode": 0.0, "cache": 0.0, "process": 0.0}
        self.gather = MediaGather(processor, fetcher, cache, limits.media, options, owner, self.timings)

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.gather.close(*exc_info)

    def layout(
        self, request: Mapping[str, Any], *, add_special_tokens: bool
    ) -> tuple[list[int], list[MultimodalItem]]:
        """Expanded token ids and unfinalized items (bundles) of ``request``."""
        check_prompt_input(request)
        has_tokens, has_features = request.get("token_ids") is not None, request.get("features") is not None
        if has_features:
            decoded = decode_features(request["features"], self.processor, max_items=self.media.max_items,
                                      max_bytes=self.media.max_feature_bytes)
            media = [Media(part=i, modality="image", features=f) for i, f in enumerate(decoded)]
        else:
            media = self.gather.collect(request.get("content_parts") or [])

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

    def _process(self, media: list[Media]) -> dict[str, Features]:
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

    def _replacements(self, media: list[Media], bundles: dict[str, Features]) -> list[list[int]]:
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

    def _expand(self, token_ids: Sequence[int], replacements: list[list[int]], media: list[Media]):
        return expand_tokens(
            token_ids, replacements, placeholder_ids=self.processor.media_placeholder_ids,
            collapsed_id=[self.processor.token_id(item.modality) for item in media],
            modalities=[item.modality for item in media], token_modality=self.processor.token_modality,
        )

    def _bundles(self, media: list[Media], bundles: dict[str, Features], offsets) -> list[MultimodalItem]:
        def meta(item: Media) -> dict[str, Any]:
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
        self, prompt: str, media: list[Media], counted: int, add_special_tokens: bool
    ) -> tuple[list[int], list[MultimodalItem]]:
        """The full HF processor over the raw prompt: the last word on where images go."""
        hf = self.processor.hf
        # Only images: the HF processors of other modalities need what this deployment lacks
        # (torchvision for video) or pair items differently; their prompts must line up.
        if any(item.modality != "image" for item in media) or prompt.count(hf.image_token) != len(media):
            raise _mismatch(counted, len(media), "prompt")
        unfetched = [item for item in media if item.decoded is None]  # cache hits: the HF processor needs pixels
        for item, data in zip(unfetched, self.gather.fetch_all(unfetched), strict=True):
            self.gather.decode(item, data)
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


def _checked_token_ids(token_ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(token_ids, list) or not token_ids:
        raise InvalidRequestError("token_ids must be a non-empty list of integers")
    check_token_ids(token_ids, vocab_size, "token_ids")
    return token_ids


__all__ = ["ProcessedPrompt", "preprocess"]
