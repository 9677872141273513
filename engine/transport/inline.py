"""``inline``: the feature's bytes travel inside the handle (safetensors, base64).

Used across nodes, for tensors below the pools' inline threshold, and as the pools' fallback
when they are full or closed. Nothing to acknowledge or free.
"""

from __future__ import annotations

from typing import Any

import torch

from .codec import decode_inline, encode_inline
from .wrapped import WrappedFeature


class InlineTransport:
    kind = "inline"

    def wrap(self, tensor: torch.Tensor) -> WrappedFeature:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"wrap takes a tensor, not {type(tensor).__name__}")
        return WrappedFeature(encode_inline(tensor))

    def reap(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_inline(handle: dict[str, Any], *, device: Any = None, hold: bool = False) -> torch.Tensor:
    # ``hold`` is accepted for a uniform opener signature: decoding always makes a new tensor.
    tensor = decode_inline(handle)
    return tensor if device is None else tensor.to(device)
