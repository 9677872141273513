"""One row's sampling masks (``SamplingParams.sampling_mask``), kept compactly a step at a time and
returned as vLLM's SamplingMask: CSR over the output tokens.

Each step's mask is the ids of its support, ascending (engine/processed_rows.py), as an int32
array on the host: a step without truncation keeps the whole vocabulary, and an array holds it in
4 bytes an id where a list of ints takes 8 for the pointer alone.

A result stores a mask packed (:func:`pack`), not as JSON lists: the ids' differences, as
little-endian uint16 (ids below 65,536) or uint32, deflated and base64'd, the offsets the same way.
A mask without truncation (every id, ascending) deflates to almost nothing, where JSON spends about
4 bytes an id; a top-k mask costs at most :data:`PACKED_BYTES_PER_ID` a listed id
(``engine/result_bound.py`` counts it so). :func:`unpack` gives the CSR lists back; every reply
shows those (``domain/jobs/results.py``, ``web/api/stored_json.py``).
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np

# The ``packed`` tag of a stored mask: the encoding of its ``token_ids`` and ``offsets``.
PACKED_U16, PACKED_U32 = "deflate-delta-u16", "deflate-delta-u32"
_DTYPES = {PACKED_U16: np.dtype("<u2"), PACKED_U32: np.dtype("<u4")}
_LEVEL = 1  # the fastest deflate: a dense mask is runs of 1 and shrinks at any level


def packed_bytes(raw_bytes: int) -> int:
    """The most bytes :func:`pack` writes for ``raw_bytes`` of array: deflate's worst case (zlib's
    ``compressBound``: stored blocks on incompressible data) in base64, with its quotes."""
    deflated = raw_bytes + (raw_bytes >> 12) + (raw_bytes >> 14) + (raw_bytes >> 25) + 13
    return 4 * ((deflated + 2) // 3) + 2


class SamplingMasks:
    """The masks of one row's tokens, in order: one :meth:`add` per token it records."""

    def __init__(self) -> None:
        self._steps: list[np.ndarray] = []

    def add(self, token_ids: np.ndarray) -> None:
        self._steps.append(token_ids)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(token_ids, offsets)``: token i's support is ``token_ids[offsets[i]:offsets[i + 1]]``;
        ``offsets`` has one entry more than the tokens."""
        offsets = np.zeros(len(self._steps) + 1, dtype=np.int64)
        np.cumsum([len(step) for step in self._steps], out=offsets[1:])
        token_ids = np.concatenate(self._steps) if self._steps else np.zeros(0, dtype=np.int32)
        return token_ids, offsets

    def csr(self) -> dict[str, list[int]]:
        """``{"token_ids": [...], "offsets": [...]}`` (:meth:`arrays` as lists)."""
        token_ids, offsets = self.arrays()
        return {"token_ids": token_ids.tolist(), "offsets": offsets.tolist()}

    def packed(self) -> dict[str, str]:
        """:meth:`arrays` as a result stores them (:func:`pack`)."""
        return pack(*self.arrays())


def pack(token_ids: np.ndarray, offsets: np.ndarray) -> dict[str, str]:
    """``{"packed": tag, "token_ids": b64, "offsets": b64}``: each array's differences (the first
    against 0) in the tag's width, deflated, base64'd. An id's difference wraps (a new step's first
    id is below the last step's last: the wrapping sum undoes it); an offset's is its step's count,
    never past the vocabulary. Written with numpy and zlib, not a format library: the arrays are
    1-D ints, and the API's readers decode them a piece at a time (``web/api/stored_json.py``)."""
    counts = np.diff(offsets)
    wide = max(int(token_ids.max(initial=0)), int(counts.max(initial=0))) >= 1 << 16
    tag = PACKED_U32 if wide else PACKED_U16
    return {"packed": tag, "token_ids": _encode(token_ids, _DTYPES[tag]), "offsets": _encode(offsets, _DTYPES[tag])}


def is_packed(mask: Any) -> bool:
    return isinstance(mask, dict) and mask.get("packed") in _DTYPES


def unpacked_arrays(mask: dict[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """The ``(token_ids, offsets)`` of a :func:`pack`'d mask: the ids in their packed width (2 or
    4 bytes an id, for a reader that writes them out a slice at a time), the offsets as int64."""
    dtype = _DTYPES[mask["packed"]]
    return _decode(mask["token_ids"], dtype, dtype), _decode(mask["offsets"], dtype, np.dtype(np.int64))


def unpack(mask: dict | None) -> dict[str, list[int]] | None:
    """The CSR lists of a stored mask: a packed one decoded, a list one (stored before packing) as is."""
    if not is_packed(mask):
        return mask
    token_ids, offsets = unpacked_arrays(mask)
    return {"token_ids": token_ids.tolist(), "offsets": offsets.tolist()}


def _encode(values: np.ndarray, dtype: np.dtype) -> str:
    deltas = np.diff(values.astype(np.int64), prepend=0).astype(dtype)  # wraps: undone by the wrapping cumsum
    return base64.b64encode(zlib.compress(deltas.tobytes(), _LEVEL)).decode("ascii")


def _decode(text: str, dtype: np.dtype, summed: np.dtype) -> np.ndarray:
    """``summed``: the sum's type, ``dtype`` itself where the differences wrap."""
    deltas = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=dtype)
    return np.cumsum(deltas, dtype=summed)
