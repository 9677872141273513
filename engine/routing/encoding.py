"""Routed experts as results store and dialects return them.

Stored and returned natively packed: ``{"dtype": "uint8", "shape": [tokens, layers, k], "data":
base64}``, the ids in C order (token, then layer, then the router's top-k order), in the smallest
integer type that holds the expert count (:func:`engine.routing.capture.expert_dtype`, little
endian). ``tokens`` counts every position fed to the model: the prompt's, then each output token
but the last (the last sampled token is never fed), so prompt + output - 1.

SGLang's ``meta_info.routed_experts`` is base64 of the same ids as int32 (what its capturer holds
and its clients decode with ``np.frombuffer(..., dtype=np.int32)``); vLLM's ``routed_experts`` is
the nested lists."""

from __future__ import annotations

import base64

import numpy as np


def pack(ids: np.ndarray) -> dict:
    ids = np.ascontiguousarray(ids)
    return {"dtype": ids.dtype.name, "shape": list(ids.shape),
            "data": base64.b64encode(ids.astype(ids.dtype.newbyteorder("<")).tobytes()).decode()}


def unpack(packed: dict) -> np.ndarray:
    dtype = np.dtype(packed["dtype"]).newbyteorder("<")
    return np.frombuffer(base64.b64decode(packed["data"]), dtype=dtype).reshape(packed["shape"])


def packed_bytes(tokens: int, layers: int, top_k: int, num_experts: int) -> int:
    """Bytes of the packed ids before base64."""
    width = 1 if num_experts <= 256 else 2 if num_experts <= 2**15 else 4
    return tokens * layers * top_k * width


def sglang_base64(packed: dict | None, start: int = 0) -> str | None:
    """SGLang's encoding: base64 of the ids as little-endian int32, from position ``start`` on
    (its ``routed_experts_start_len``)."""
    if packed is None:
        return None
    return base64.b64encode(unpack(packed)[start:].astype("<i4").tobytes()).decode()


def nested(packed: dict | None) -> list | None:
    """vLLM's: ``[[[id, ...] per layer] per token]``."""
    return None if packed is None else unpack(packed).tolist()
