"""The wire format of precomputed features: what a client sends as a request's ``features``.

Precomputed ``features`` (instead of ``content_parts``), one entry per image, in prompt order::

    {"modality": "image",
     "tensors": {NAME: {"dtype": "float32" | "float16" | "bfloat16" | "int64" | "int32",
                        "shape": [int, ...],
                        "data": base64 of the raw little-endian bytes, C order}}}

``NAME`` is exactly the model's feature names (:attr:`MultimodalProcessor.feature_names`, e.g.
``pixel_values`` and ``image_grid_thw`` for Qwen-VL), shaped for one image as the model's image
processor makes them. Anything else is an :class:`InvalidFeaturesError` (422) naming the field.
:func:`encode_features` writes the format.
"""

from __future__ import annotations

import binascii
import math
import sys
from collections.abc import Mapping
from typing import Any

import pybase64
import torch

from engine.errors import PayloadTooLargeError
from engine.request_rules import check_media_count
from processors.base import Features, MultimodalProcessor
from processors.errors import InvalidFeaturesError, UnsupportedModalityError

# The largest magnitude a float feature may hold: fp16's largest finite value. Pixel values and
# media embeddings are orders of magnitude smaller; anything past it overflows a 16-bit forward
# and, in fp32, turns attention into NaN (3e38 did), so it is refused like NaN itself.
MAX_FEATURE_MAGNITUDE = 65504.0

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32,
}


def encode_features(features: Mapping[str, torch.Tensor], modality: str = "image") -> dict[str, Any]:
    """One image's features in the request format (see the module docstring)."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    return {
        "modality": modality,
        "tensors": {
            name: {
                "dtype": names[tensor.dtype],
                "shape": list(tensor.shape),
                "data": pybase64.b64encode_as_string(_le_bytes(tensor)),
            }
            for name, tensor in features.items()
        },
    }


def decode_features(entries: Any, processor: MultimodalProcessor, *, max_items: int, max_bytes: int) -> list[Features]:
    """Decode and validate precomputed ``features`` strictly; one feature dict per image. At most
    ``max_items`` entries and ``max_bytes`` of tensors in all."""
    if not isinstance(entries, list) or not entries:
        raise InvalidFeaturesError("features must be a non-empty list", errors={"path": "features"})
    check_media_count(len(entries), max_items, "feature entries")
    budget = max_bytes
    decoded = []
    for i, entry in enumerate(entries):
        path = f"features[{i}]"
        _require(isinstance(entry, dict) and set(entry) == {"modality", "tensors"}, path,
                 "must be an object with exactly the keys modality and tensors")
        if entry["modality"] != "image":
            raise UnsupportedModalityError(
                f"{path}.modality: precomputed features are taken for images only; send videos and "
                "audio as content_parts", errors={"path": f"{path}.modality"},
            )
        if entry["modality"] not in processor.modalities:
            raise UnsupportedModalityError(
                f"{path}.modality: this model takes {', '.join(sorted(processor.modalities))}",
                errors={"path": f"{path}.modality"},
            )
        tensors = entry["tensors"]
        _require(isinstance(tensors, dict) and set(tensors) == set(processor.feature_names), f"{path}.tensors",
                 f"must hold exactly {', '.join(sorted(processor.feature_names))}")
        features = {}
        for name in sorted(tensors):
            features[name] = _decode_tensor(tensors[name], f"{path}.tensors.{name}", budget)
            budget -= features[name].nbytes
        try:
            processor.validate_features(features)
        except InvalidFeaturesError as exc:
            raise InvalidFeaturesError(f"{path}: {exc.message}", errors={"path": path}) from None
        decoded.append(features)
    return decoded


def _decode_tensor(spec: Any, path: str, budget: int) -> torch.Tensor:
    _require(isinstance(spec, dict) and set(spec) == {"dtype", "shape", "data"}, path,
             "must be an object with exactly the keys dtype, shape and data")
    dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    _require(dtype is not None, f"{path}.dtype", f"must be one of {', '.join(DTYPES)}")
    shape = spec["shape"]
    _require(isinstance(shape, list) and 1 <= len(shape) <= 8
             and all(type(d) is int and 0 <= d for d in shape), f"{path}.shape",
             "must be a list of 1 to 8 non-negative integers")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > budget:
        raise PayloadTooLargeError(f"{path}: the precomputed features exceed the size limit")
    _require(isinstance(spec["data"], str), f"{path}.data", "must be a base64 string")
    try:
        raw = pybase64.b64decode(spec["data"], validate=True)  # SIMD: tensors run to megabytes
    except (binascii.Error, ValueError):
        raise InvalidFeaturesError(f"{path}.data: not valid base64", errors={"path": f"{path}.data"}) from None
    _require(len(raw) == nbytes, f"{path}.data", f"holds {len(raw)} bytes, the dtype and shape need {nbytes}")
    tensor = _from_le_bytes(raw, dtype).reshape(shape)
    if tensor.is_floating_point():
        _require(bool(torch.isfinite(tensor).all()), path, "holds NaN or infinite values")
        _require(tensor.numel() == 0 or float(tensor.abs().max()) <= MAX_FEATURE_MAGNITUDE, path,
                 f"holds a value of magnitude over {MAX_FEATURE_MAGNITUDE:g}")
    return tensor


def _require(ok: bool, path: str, what: str) -> None:
    if not ok:
        raise InvalidFeaturesError(f"{path}: {what}", errors={"path": path})


def _le_bytes(tensor: torch.Tensor) -> bytes:
    raw = tensor.detach().cpu().contiguous().reshape(-1)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise NotImplementedError("feature encoding assumes a little-endian host")
    return raw.view(torch.uint8).numpy().tobytes()


def _from_le_bytes(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    if sys.byteorder != "little":  # pragma: no cover
        raise NotImplementedError("feature decoding assumes a little-endian host")
    if not raw:
        return torch.empty(0, dtype=dtype)
    # bytearray: a writable private copy, so the tensor owns its memory.
    return torch.frombuffer(bytearray(raw), dtype=dtype)
