"""Finalized multimodal items: what the processors hand the engine.

The lifecycle is fixed (see ``processors.finalize``): a model hook reshapes the item while its
features are real tensors, then pad value and content hash are set, then every feature is wrapped
for transport, last. After the wrap, features are opaque handles; the GPU side opens them back
into tensors before the model sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def placeholder_range(modality: str, start: int, end: int) -> dict[str, Any]:
    """A media placeholder run ``[start, end)`` in the one shape results report it in:
    ``{"modality", "offset": start, "length"}``."""
    return {"modality": modality, "offset": start, "length": end - start}


@dataclass
class MultimodalItem:
    modality: str  # "image" | "video" | "audio"
    # Model inputs for this item, e.g. {"pixel_values": ..., "image_grid_thw": ...}. Real tensors
    # until the transport wrap; afterwards each value is a ``engine.transport.WrappedFeature``.
    features: dict[str, Any]
    # Placeholder range [start, end) of this item in the prompt token ids.
    offset: tuple[int, int]
    content_hash: str = ""
    pad_value: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The features as tensors; fails on wrapped ones (open them with the transport first)."""
        out = {}
        for name, value in self.features.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"feature {name!r} is wrapped for transport; open it first")
            out[name] = value
        return out
