"""Acknowledgements from consumers to the producer pool, through Redis.

A consumer that is done with a feature pushes its id onto the pool's list
``rq:transport:acks:<pool_id>``; the pool drains that list on every wrap and in ``reap()`` and
frees the regions. A lost ack only delays reuse until the pool's ``ack_timeout`` reclaims the
region, so acknowledging never fails a job.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import redis
import torch

from .wrapped import WrappedFeature

log = logging.getLogger(__name__)

ACK_KEY_PREFIX = "rq:transport:acks:"
# An ack list outlives its pool only if the producer died; expire it instead of leaking keys.
ACK_KEY_TTL_S = 3600
_DRAIN_BATCH = 1024


def ack_key(pool_id: str) -> str:
    return f"{ACK_KEY_PREFIX}{pool_id}"


def acknowledge(client: redis.Redis, handles: Iterable[dict[str, Any] | WrappedFeature]) -> bool:
    """Tell the producers these features are released; one Redis round trip for all of them.

    Call it when the consumer no longer uses the opened tensors (for ``cuda_ipc`` the opened
    tensor is a view of the producer's memory, so ack only after the last kernel that reads it;
    this function synchronizes the current CUDA stream first). Inline handles need no ack.
    Returns False when Redis failed (logged): the producer then reclaims on timeout.
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
    try:
        pipe = client.pipeline(transaction=False)
        for pool_id, ids in by_pool.items():
            pipe.rpush(ack_key(pool_id), *ids)
            pipe.expire(ack_key(pool_id), ACK_KEY_TTL_S)
        pipe.execute()
    except redis.RedisError:
        log.warning(
            "could not acknowledge %d feature(s); the producer reclaims them on timeout",
            sum(map(len, by_pool.values())),
            exc_info=True,
        )
        return False
    return True


def drain(client: redis.Redis, pool_id: str) -> list[str] | None:
    """Pop every pending ack of a pool (the producer side); None when Redis failed (logged)."""
    ids: list[str] = []
    try:
        while True:
            batch = client.lpop(ack_key(pool_id), _DRAIN_BATCH)
            if not batch:
                break
            ids.extend(b.decode() if isinstance(b, bytes) else b for b in batch)
            if len(batch) < _DRAIN_BATCH:
                break
    except redis.RedisError:
        log.warning("could not drain acks of pool %s", pool_id, exc_info=True)
        return None
    return ids


def discard(client: redis.Redis, pool_id: str) -> None:
    try:
        client.delete(ack_key(pool_id))
    except redis.RedisError:
        log.warning("could not delete the ack list of pool %s", pool_id, exc_info=True)
