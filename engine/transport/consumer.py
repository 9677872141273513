"""The consumer side: open any handle by its kind."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.errors import TransportError

from . import cuda_ipc, shm
from .ack_channel import AckChannel
from .acks import acknowledge
from .inline import open_inline
from .wrapped import WrappedFeature

_OPENERS = {"inline": open_inline, "shm": shm.open_shm, "cuda_ipc": cuda_ipc.open_cuda_ipc}


def open_feature(
    handle: dict[str, Any] | WrappedFeature, *, device: Any = None, hold: bool = False
) -> torch.Tensor:
    """The tensor behind a handle.

    ``inline`` and ``shm`` give a private copy (default on CPU); ``cuda_ipc`` gives a zero-copy
    view on the producer's GPU unless ``device`` names another device. With ``hold=True`` shm
    gives a zero-copy view too: the caller holds the producer's memory and must not use the
    tensor after acknowledging. Acknowledge non-inline handles with ``acknowledge`` once done
    (after a copy: right away). ``opened`` does hold + acknowledge as one block.

    Raises HandleUnavailableError (retryable: re-preprocess) when the producer's memory is gone,
    TransportError for a malformed handle.
    """
    handle = _unwrap(handle)
    return _opener(handle)(handle, device=device, hold=hold)


@contextmanager
def opened(
    acks: AckChannel, handles: Iterable[dict[str, Any] | WrappedFeature], *, device: Any = None
) -> Iterator[list[torch.Tensor]]:
    """Use features while held: tensors valid inside the block, zero-copy wherever the memory
    allows (shm on CPU, cuda_ipc on its own device), acknowledged when the block ends (also on
    error). Nothing may keep them past the block: the producer reuses the memory after the ack.
    """
    handles = [_unwrap(h) for h in handles]
    try:
        yield [_opener(h)(h, device=device, hold=True) for h in handles]
    finally:
        acknowledge(acks, handles)


def _unwrap(handle: dict[str, Any] | WrappedFeature) -> dict[str, Any]:
    return handle.handle if isinstance(handle, WrappedFeature) else handle


def _opener(handle: dict[str, Any]):
    opener = _OPENERS.get(handle.get("kind") if isinstance(handle, dict) else None)
    if opener is None:
        kind = handle.get("kind") if isinstance(handle, dict) else None
        raise TransportError(f"unknown feature handle kind {kind!r}")
    return opener


def close_consumer_mappings() -> None:
    """Unmap every producer buffer this process opened as a consumer (worker shutdown, tests)."""
    shm.close_consumer_mappings()
    cuda_ipc.close_consumer_mappings()
