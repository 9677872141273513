"""Acknowledgements from consumers to the producer pool, through an :class:`AckChannel`.

A consumer that is done with features posts their ids per pool on the channel; the pool drains
its ids on every wrap and in ``reap()`` and frees the regions. A lost ack only delays reuse
until the pool's ``ack_timeout`` reclaims the region, so acknowledging never fails a job.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from .ack_channel import AckChannel
from .wrapped import WrappedFeature

log = logging.getLogger(__name__)


def acknowledge(channel: AckChannel, handles: Iterable[dict[str, Any] | WrappedFeature]) -> bool:
    """Tell the producers these features are released; one ``send`` for all of them.

    Call it when the consumer no longer uses the opened tensors (for ``cuda_ipc`` the opened
    tensor is a view of the producer's memory, so ack only after the last kernel that reads it;
    this function synchronizes the current CUDA stream first). Inline handles need no ack.
    Returns False when the channel failed: the producer then reclaims on timeout.
    """
    by_pool: dict[str, list[str]] = defaultdict(list)
    cuda_devices: set[int] = set()
    for item in handles:
        handle = item.handle if isinstance(item, WrappedFeature) else item
        pool_id, feature_id = handle.get("pool"), handle.get("id")
        if (
            handle.get("kind") not in ("shm", "cuda_ipc")
            or not isinstance(pool_id, str)
            or not isinstance(feature_id, str)
        ):
            continue  # inline (nothing to free) or not ours to acknowledge
        by_pool[pool_id].append(feature_id)
        if handle["kind"] == "cuda_ipc" and isinstance(handle.get("ipc"), dict):
            cuda_devices.add(handle["ipc"].get("device"))
    if not by_pool:
        return True
    if cuda_devices and torch.cuda.is_available():
        # Kernels reading the producer's memory may still be queued; the region is reused after the ack.
        for device in cuda_devices:
            if isinstance(device, int):
                torch.cuda.current_stream(device).synchronize()
    if not channel.send(dict(by_pool)):
        log.warning(
            "could not acknowledge %d feature(s); the producer reclaims them on timeout",
            sum(map(len, by_pool.values())),
        )
        return False
    return True
