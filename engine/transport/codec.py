"""Handle fields shared by every transport: dtype names, shapes, and the inline (bytes) codec.

A handle is a small JSON-safe dict. Every kind carries ``kind``, ``v`` (format version),
``dtype`` (torch dtype name without the ``torch.`` prefix), ``shape`` (list of ints) and
``nbytes``; the kinds add their own fields (see the package docstring).
"""

from __future__ import annotations

import binascii
from typing import Any

import pybase64
import safetensors
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.errors import TransportError

HANDLE_VERSION = 1
# The single key inside the safetensors blob of an inline handle.
_INLINE_KEY = "t"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TransportError(f"feature handle names an unknown dtype {name!r}")
    return dtype


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def base_fields(kind: str, tensor: torch.Tensor) -> dict[str, Any]:
    return {
        "kind": kind,
        "v": HANDLE_VERSION,
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "nbytes": nbytes_of(tensor),
    }


def field(handle: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """One typed field of a handle; a malformed handle is a TransportError, not a KeyError."""
    value = handle.get(name) if isinstance(handle, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise TransportError(f"feature handle has no valid {name!r} field")
    return value


def layout(handle: dict[str, Any]) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, nbytes) of a handle, checked against each other."""
    dtype = parse_dtype(handle.get("dtype") if isinstance(handle, dict) else None)
    shape = field(handle, "shape", list)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise TransportError("feature handle has an invalid shape")
    nbytes = field(handle, "nbytes", int)
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != nbytes:
        raise TransportError("feature handle's nbytes does not match its dtype and shape")
    return dtype, tuple(shape), nbytes


# --- inline: safetensors bytes, base64 in JSON ------------------------------------------------
# safetensors rather than torch.save: no pickle on the consumer side, and every dtype the models
# use (bfloat16, float8) has a defined byte layout.


def encode_inline(tensor: torch.Tensor) -> dict[str, Any]:
    handle = base_fields("inline", tensor)
    blob = st_save({_INLINE_KEY: tensor.detach().to("cpu").contiguous()})
    handle["data"] = pybase64.b64encode_as_string(blob)  # SIMD: features run to megabytes
    return handle


def decode_inline(handle: dict[str, Any]) -> torch.Tensor:
    dtype, shape, _ = layout(handle)
    try:
        blob = pybase64.b64decode(field(handle, "data", str), validate=True)
        tensor = st_load(blob)[_INLINE_KEY]
    except (binascii.Error, KeyError, safetensors.SafetensorError) as exc:
        raise TransportError("inline feature handle does not hold a valid tensor") from exc
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise TransportError("inline feature handle's data does not match its dtype and shape")
    return tensor
