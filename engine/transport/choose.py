"""Which transport a producer uses, and building it from settings values."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .ack_channel import AckChannel
from .cuda_ipc import CudaIpcPool
from .inline import InlineTransport
from .pool import DEFAULT_INLINE_THRESHOLD
from .shm import ShmPool
from .wrapped import WrappedFeature

KINDS = ("inline", "shm", "cuda_ipc")


class FeatureTransport(Protocol):
    """What the finalize step wraps with (the producer side). Consumers open handles of any kind
    with ``engine.transport.open_feature``."""

    kind: str

    def wrap(self, tensor: torch.Tensor) -> WrappedFeature:
        """Copy the tensor into transport memory; never raises for lack of room (goes inline)."""

    def reap(self) -> int:
        """Free acknowledged and timed-out memory now; returns how many features were freed."""

    def close(self) -> None:
        """Free everything this transport owns (worker shutdown)."""


def choose_transport(preferred: str, *, cuda_available: bool, same_node: bool = True) -> str:
    """The transport kind to use: ``auto`` is cuda_ipc with CUDA, else shm; inline across nodes.

    An explicit ``cuda_ipc`` without CUDA is a configuration error (ValueError), not a fallback.
    """
    if preferred != "auto" and preferred not in KINDS:
        raise ValueError(f"unknown feature transport {preferred!r}; expected auto or one of {KINDS}")
    if not same_node:
        return "inline"
    if preferred == "auto":
        return "cuda_ipc" if cuda_available else "shm"
    if preferred == "cuda_ipc" and not cuda_available:
        raise ValueError("feature transport cuda_ipc needs CUDA, which is not available here")
    return preferred


def make_transport(
    kind: str,
    *,
    acks: AckChannel | None = None,
    capacity_bytes: int = 256 << 20,
    ack_timeout: float = 60.0,
    wait_timeout: float = 1.0,
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    device: Any = None,
) -> FeatureTransport:
    """Build the producer's transport of a kind from ``choose_transport``; pools need ``acks``."""
    if kind == "inline":
        return InlineTransport()
    if kind not in KINDS:
        raise ValueError(f"unknown feature transport {kind!r}")
    if acks is None:
        raise ValueError(f"the {kind} transport needs an AckChannel for acknowledgements")
    options = {
        "capacity_bytes": capacity_bytes,
        "ack_timeout": ack_timeout,
        "wait_timeout": wait_timeout,
        "inline_threshold": inline_threshold,
    }
    if kind == "shm":
        return ShmPool(acks, **options)
    return CudaIpcPool(acks, device=device, **options)
