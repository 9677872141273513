"""Finalize multimodal items, in the one fixed order every processor goes through:

1. the model hook (``MultimodalProcessor.split_features``) reshapes each item while its features
   are real tensors: a bundle of several images becomes one item per image, each with its own
   placeholder offset; counts of images, features and offsets must add up or it fails loudly;
2. content hash (kept when cached features brought theirs) and pad value of every item;
3. transport wrap of every feature, last: from here on features are opaque handles.

The hook runs on every item, cached ones included (on a one-image item it is the identity), so a
cached and an uncached item come out of the same code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any, Protocol

import torch

from engine.items import MultimodalItem
from processors.base import MultimodalProcessor
from processors.errors import ItemLayoutError


class Wrapper(Protocol):
    def wrap(self, tensor: torch.Tensor) -> Any: ...


def bundle_item(
    modality: str, features: dict[str, torch.Tensor], offsets: Sequence[tuple[int, int]],
    per_image: Sequence[dict[str, Any]],
) -> MultimodalItem:
    """An item holding the features of several images as the HF processor returned them, with
    each image's placeholder offset and metadata, for the model hook to split."""
    return MultimodalItem(
        modality=modality,
        features=features,
        offset=(min(start for start, _ in offsets), max(end for _, end in offsets)) if offsets else (0, 0),
        metadata={"offsets": [tuple(o) for o in offsets], "per_image": [dict(m) for m in per_image]},
    )


def finalize(
    items: Sequence[MultimodalItem],
    *,
    processor: MultimodalProcessor,
    transport: Wrapper,
    before_wrap: Callable[[list[MultimodalItem]], None] | None = None,
) -> list[MultimodalItem]:
    """Run the lifecycle over ``items``; returns one wrapped item per image, in prompt order.

    ``before_wrap`` sees the per-image items with real tensors, hashed, right before the wrap
    (the multimodal cache stores them there).
    """
    split = split_items(items, processor)
    for item in split:
        # A hash that came with cached features was made by content_hash() when they were stored.
        item.content_hash = item.content_hash or content_hash(item.features)
        # A per-content id in place of the placeholder tokens lets a token-keyed prefix cache
        # tell two images apart (SGLang's pad_value); kept below 2**30 to stay a valid int32.
        item.pad_value = int(item.content_hash[:15], 16) % (1 << 30)
    if before_wrap is not None:
        before_wrap(split)
    for item in split:
        item.features = {name: transport.wrap(tensor) for name, tensor in item.features.items()}
    return split


def split_items(items: Sequence[MultimodalItem], processor: MultimodalProcessor) -> list[MultimodalItem]:
    """Step 1 alone: one item per image with real tensors, in prompt order (the cache stores
    these; finalize continues from here)."""
    split = sorted((piece for item in items for piece in _split(item, processor)), key=lambda i: i.offset)
    for before, after in pairwise(split):
        if after.offset[0] < before.offset[1]:
            raise ItemLayoutError(f"placeholder ranges {before.offset} and {after.offset} overlap")
    return split


def _split(item: MultimodalItem, processor: MultimodalProcessor) -> list[MultimodalItem]:
    offsets = item.metadata.get("offsets", [item.offset])
    per_image = item.metadata.get("per_image", [{}] * len(offsets))
    pieces = processor.split(item.modality, item.tensors())
    if not len(pieces) == len(offsets) == len(per_image):
        raise ItemLayoutError(
            f"a {item.modality} bundle split into {len(pieces)} feature sets for {len(offsets)} "
            f"placeholder offsets and {len(per_image)} items"
        )
    out = []
    for features, (start, end), metadata in zip(pieces, offsets, per_image, strict=True):
        expected = len(processor.replacement(item.modality, features, 0))
        if end - start != expected:
            raise ItemLayoutError(f"a placeholder range of {end - start} tokens for features that need {expected}")
        metadata = dict(metadata)
        known_hash = metadata.pop("content_hash", "")
        out.append(MultimodalItem(item.modality, features, (start, end), known_hash, metadata=metadata))
    return out


def content_hash(features: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes of the features (names sorted)."""
    digest = hashlib.sha256()
    for name in sorted(features):
        tensor = features[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()
