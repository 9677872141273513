"""Model keyword arguments from finalized multimodal items (the GPU side's half of the contract).

Items arrive one per image, in prompt order, with real tensors (opened from their transport
handles). The model takes each feature of all images in one tensor along dim 0, in placeholder
order: Qwen-VL patches and grids concatenate as they are; images of different sizes (Pixtral)
are zero-padded to the largest size first, which is what their image processor does to a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.items import MultimodalItem


def build_mm_kwargs(items: Sequence[MultimodalItem]) -> dict[str, torch.Tensor]:
    """``{feature name: tensor}`` for the model, from ``items`` in prompt order.

    Fails on wrapped features (open them first) and on features of one name with different
    ranks or dtypes.
    """
    per_name: dict[str, list[torch.Tensor]] = {}
    for item in sorted(items, key=lambda i: i.offset):
        for name, tensor in item.tensors().items():
            per_name.setdefault(name, []).append(tensor)
    return {name: _concat(name, tensors) for name, tensors in per_name.items()}


def _concat(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    if len({t.dim() for t in tensors}) != 1 or len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"feature {name!r} has items of different ranks or dtypes")
    trailing = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors), strict=True)]
    padded = []
    for tensor in tensors:
        # F.pad takes (last_lo, last_hi, second_last_lo, ...): pad each trailing dim at its end.
        gaps = [want - have for want, have in zip(trailing, tensor.shape[1:], strict=True)]
        padding = [amount for gap in reversed(gaps) for amount in (0, gap)]
        padded.append(F.pad(tensor, padding) if any(gaps) else tensor)
    return torch.cat(padded, dim=0)
