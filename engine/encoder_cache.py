"""Vision-encoder outputs, computed once per media item and kept by content hash (LRU, bytes).

transformers 5.x lets a model's forward take its encoder's output instead of pixels
(``mm_encoder_outputs``, the seam ``generate`` itself uses to encode before prefill): the engine
encodes each media unit on its own with the model's ``get_image_features`` /
``get_video_features`` and hands the forward the outputs of a batch's units, combined in
placeholder order. A unit is one finalized item (keyed by its ``content_hash``), or all the media
of a request given as ready ``mm_kwargs`` (keyed by a hash of its tensors). A second epoch over
the same images then skips the vision tower; encoding each unit alone also makes a row's media
features independent of its batch neighbours.

Keys carry the weight version: outputs of other weights are never reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

# The main input of each modality's encoder, as transformers names it.
_ENCODER_INPUTS = {"image": ("pixel_values", "pixel_values_images"), "video": ("pixel_values_videos",)}


@dataclass
class MediaUnit:
    key: str  # content key: what the encoder output depends on
    features: Mapping[str, torch.Tensor]
    span: tuple[int, int]  # [start, end) of its placeholders in the prompt


@dataclass
class EncoderStats:
    calls: int = 0  # units run through the vision tower
    hits: int = 0  # units served from the cache


@dataclass
class EncoderCache:
    """LRU of encoder outputs by unit key, at most ``max_bytes`` of tensors (0 turns it off)."""

    max_bytes: int
    stats: EncoderStats = field(default_factory=EncoderStats)
    _entries: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _bytes: int = 0

    def get(self, key: str):
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return None if entry is None else entry[0]

    def put(self, key: str, outputs: dict[str, Any]) -> None:
        size = sum(_nbytes(out) for out in outputs.values())
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = (outputs, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes


def supports_encoder_outputs(model) -> bool:
    return "mm_encoder_outputs" in inspect.signature(model.forward).parameters


def encoder_input_names(model) -> set[str]:
    """Feature names consumed by the model's encoders (they do not go to the forward as well)."""
    names: set[str] = set()
    for modality in _ENCODER_INPUTS:
        fn = getattr(model.base_model, f"get_{modality}_features", None)
        if fn is not None:
            names.update(p for p in inspect.signature(fn).parameters if p != "kwargs")
    return names


def unit_key(weight_version: str, content: str) -> str:
    return f"{weight_version}:{content}"


def tensors_hash(features: Mapping[str, torch.Tensor]) -> str:
    """A content hash of ready-made features (a request that gave tensors, not finalized items)."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(features):
        tensor = features[name].detach().contiguous().cpu()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def encode(model, units: Sequence[MediaUnit], cache: EncoderCache | None) -> dict[str, Any]:
    """``{modality: encoder output}`` for ``units`` in order, each unit encoded alone or taken
    from ``cache``; the ``mm_encoder_outputs`` a forward over exactly these units takes."""
    per_modality: dict[str, list] = {}
    for unit in units:
        outputs = cache.get(unit.key) if cache is not None else None
        if outputs is None:
            outputs = _encode_unit(model, unit.features)
            if cache is not None:
                cache.stats.calls += 1
                cache.put(unit.key, outputs)
        elif cache is not None:
            cache.stats.hits += 1
        for modality, output in outputs.items():
            per_modality.setdefault(modality, []).append(output)
    return {modality: _combine(outputs) for modality, outputs in per_modality.items()}


def _encode_unit(model, features: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    out = {}
    for modality, inputs in _ENCODER_INPUTS.items():
        fn = getattr(model.base_model, f"get_{modality}_features", None)
        if fn is None or not any(name in features for name in inputs):
            continue
        kwargs = {name: features[name] for name in inspect.signature(fn).parameters
                  if name != "kwargs" and name in features}
        output = fn(**kwargs, return_dict=True)
        if getattr(output, "pooler_output", None) is not None and hasattr(output, "last_hidden_state"):
            # The forward merges pooler_output (and deepstack features) only; the raw hidden
            # states would double what the cache holds.
            output.last_hidden_state = None
        out[modality] = output
    return out


def _combine(outputs: list):
    """One encoder output of several units: per field, tensors concatenated along dim 0, tuples
    of per-item tensors chained, lists of per-layer tuples (Qwen3-VL's deepstack) chained per layer."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    values = {}
    for f in dataclasses.fields(first):
        parts = [getattr(out, f.name) for out in outputs]
        if all(p is None for p in parts):
            values[f.name] = None
        elif isinstance(parts[0], torch.Tensor):
            values[f.name] = torch.cat(parts, dim=0)
        elif parts[0] and isinstance(parts[0][0], list | tuple):
            values[f.name] = [tuple(chain.from_iterable(layer)) for layer in zip(*parts, strict=True)]
        else:
            values[f.name] = tuple(chain.from_iterable(parts))
    return type(first)(**values)


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if dataclasses.is_dataclass(value):
        return sum(_nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0
