"""A left-padded batched KV cache that rows join and leave between decode steps.

transformers' :class:`~transformers.DynamicCache` holds per layer ``keys``/``values`` of shape
(batch, heads, length, head_dim) and can already drop rows (``batch_select_indices``). What it
lacks is adding rows to a running cache: that is written here. Rows are left-padded, so every
row's newest token is the last column and one ``attention_mask`` (zeros over padding) serves the
model's own mask building; a row that joins is padded on the left to the running width (or the
running rows are, when it is longer).

Only full-attention ``DynamicLayer`` caches are supported (every model we register); a sliding
window layer keeps a different length per layer and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


@dataclass
class PromptKV:
    """One prompt's KV, unpadded: per layer (keys, values) of shape (1, heads, length, dim)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[-2]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


def split_rows(cache: DynamicCache, attention_mask: torch.Tensor) -> list[PromptKV]:
    """Each row of a left-padded prefill cache, without its padding, as its own copy."""
    layers = _layers(cache)
    lengths = attention_mask.sum(-1).tolist()
    width = attention_mask.shape[-1]
    out = []
    for row, length in enumerate(lengths):
        start = width - int(length)
        out.append(PromptKV([(layer.keys[row:row + 1, :, start:].clone(), layer.values[row:row + 1, :, start:].clone())
                             for layer in layers]))
    return out


def append_rows(cache: DynamicCache | None, attention_mask: torch.Tensor | None,
                prompts: Sequence[PromptKV], *, config) -> tuple[DynamicCache, torch.Tensor]:
    """The running ``cache`` and its mask with ``prompts`` added as new rows at the end.

    One new tensor per layer: the running rows and the new ones, each right-aligned (left padding
    with zeros, masked out) to the longer of the running width and the longest new prompt.
    """
    running = 0 if cache is None else attention_mask.shape[0]
    width_now = 0 if cache is None else attention_mask.shape[1]
    width = max([width_now, *(p.length for p in prompts)])
    template = prompts[0].layers if prompts else None
    if cache is None:
        cache = DynamicCache(config=config)
    layers = _layers(cache) if running else None
    rows = running + len(prompts)
    mask_device = template[0][0].device if template else attention_mask.device
    mask = torch.zeros((rows, width), dtype=torch.long, device=mask_device)
    if running:
        mask[:running, width - width_now:] = attention_mask
    for j, prompt in enumerate(prompts):
        mask[running + j, width - prompt.length:] = 1
    merged = []
    for index in range(len(template) if template else len(layers)):
        reference = template[index][0] if template else layers[index].keys
        heads, dim = reference.shape[1], reference.shape[3]
        keys = reference.new_zeros((rows, heads, width, dim))
        values = reference.new_zeros((rows, heads, width, dim))
        if running:
            keys[:running, :, width - width_now:] = layers[index].keys
            values[:running, :, width - width_now:] = layers[index].values
        for j, prompt in enumerate(prompts):
            k, v = prompt.layers[index]
            keys[running + j, :, width - prompt.length:] = k[0]
            values[running + j, :, width - prompt.length:] = v[0]
        merged.append((keys, values))
    out = DynamicCache(config=config)
    for layer, (keys, values) in zip(_layers(out, allow_empty=True), merged, strict=True):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return out, mask


def keep_rows(cache: DynamicCache, attention_mask: torch.Tensor, keep: Sequence[int]) -> tuple[DynamicCache, torch.Tensor]:
    """Only the rows ``keep`` (indices), then without the leading columns that are padding in every
    kept row: the cache is as wide as its longest live row, not its longest row ever."""
    index = torch.as_tensor(list(keep), dtype=torch.long, device=attention_mask.device)
    cache.batch_select_indices(index)
    mask = attention_mask.index_select(0, index)
    live_columns = mask.any(0).nonzero()
    start = int(live_columns[0]) if len(live_columns) else mask.shape[1]
    if start:
        for layer in _layers(cache):
            layer.keys = layer.keys[:, :, start:]
            layer.values = layer.values[:, :, start:]
        mask = mask[:, start:]
    return cache, mask


def _layers(cache: DynamicCache, *, allow_empty: bool = False) -> list[DynamicLayer]:
    layers = list(cache.layers)
    for layer in layers:
        if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(layer, DynamicLayer):
            raise NotImplementedError(f"cache layer {type(layer).__name__} cannot be batched by rows")
        if not allow_empty and not layer.is_initialized:
            raise ValueError("a cache layer holds nothing")
    return layers
