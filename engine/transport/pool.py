"""The producer side shared by ``shm`` and ``cuda_ipc``: a bounded pool with acks and backpressure.

A pool owns one fixed buffer of ``capacity_bytes`` (a shared-memory segment, or one CUDA
allocation) and hands out regions of it. Each region starts with a 64-byte header holding the
feature id (8 random bytes; zero once freed), then the tensor's bytes. Consumers compare the
header with the id in their handle, so a handle whose region was reclaimed and reused is
reported as unavailable instead of silently yielding another feature's data.

Lifetimes: a region is live from ``wrap`` until the consumer's ack (drained from the pool's
``AckChannel`` on every wrap and in ``reap``) or until ``ack_timeout`` seconds pass, whichever
comes first. A full pool makes ``wrap`` wait up to ``wait_timeout`` seconds for regions to come back, then fall back to
an inline handle: wrap never raises for lack of room and the pool never grows.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .ack_channel import AckChannel
from .codec import base_fields, encode_inline, nbytes_of
from .regions import RegionAllocator
from .wrapped import WrappedFeature

# Region header: the feature id in the first 8 bytes, padded so tensor data stays 64-byte aligned
# (every dtype's alignment, and whole cache lines).
HEADER_BYTES = 64
ID_BYTES = 8
DEFAULT_INLINE_THRESHOLD = 64 * 1024
# How long a wrap waiting for room sleeps between drains of the ack list.
_POLL_INTERVAL_S = 0.01
# After the ack channel failed, acks are not drained for this long (regions still come back by timeout).
_DRAIN_PAUSE_AFTER_ERROR_S = 1.0
# close() waits this long for wraps that are copying into the buffer before unmapping it.
_CLOSE_WAIT_S = 10.0


def new_feature_id() -> str:
    # Random, not a counter: a stale handle may point into the middle of another feature's data,
    # and small integers are common tensor values. "| 1" keeps it distinct from a freed header.
    return f"{secrets.randbits(8 * ID_BYTES) | 1:0{2 * ID_BYTES}x}"


@dataclass(slots=True)
class _Lease:
    id: str
    offset: int  # start of the region (its header)
    size: int  # bytes reserved in the allocator
    deadline: float = math.inf


class RegionPool(ABC):
    """Base of the node-local pools; subclasses say where the buffer lives and how to copy."""

    kind: ClassVar[str]
    align: ClassVar[int] = HEADER_BYTES

    def __init__(
        self,
        acks: AckChannel,
        *,
        capacity_bytes: int,
        ack_timeout: float = 60.0,
        wait_timeout: float = 1.0,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    ):
        if capacity_bytes < HEADER_BYTES + self.align:
            raise ValueError(f"capacity_bytes must be at least {HEADER_BYTES + self.align}")
        if ack_timeout <= 0 or wait_timeout < 0 or inline_threshold < 0:
            raise ValueError("ack_timeout must be positive; wait_timeout, inline_threshold >= 0")
        self.pool_id = secrets.token_hex(6)
        self.ack_timeout = ack_timeout
        self.wait_timeout = wait_timeout
        self.inline_threshold = inline_threshold
        self._acks = acks
        self._alloc = RegionAllocator(capacity_bytes, self.align)
        self._cond = threading.Condition()
        self._live: dict[str, _Lease] = {}  # insertion order == deadline order
        self._writers = 0
        self._closed = False
        self._drain_lock = threading.Lock()
        self._last_drain = -math.inf
        self._drain_paused_until = -math.inf
        self._counts: Counter[str] = Counter()

    # --- what a subclass provides ---------------------------------------------------------

    @abstractmethod
    def _write(self, lease: _Lease, tensor: torch.Tensor) -> None:
        """Copy the tensor to the region's data, then its id to the header (called unlocked)."""

    @abstractmethod
    def _invalidate(self, lease: _Lease) -> None:
        """Zero the region's header so stale handles fail (called under the lock)."""

    @abstractmethod
    def _handle_fields(self) -> dict[str, Any]:
        """Kind-specific handle fields (where the buffer is)."""

    @abstractmethod
    def _release(self) -> None:
        """Give the buffer back (unmap/unlink); called once, from close()."""

    # --- FeatureTransport -----------------------------------------------------------------

    def wrap(self, tensor: torch.Tensor) -> WrappedFeature:
        """Copy the tensor into the pool and return its handle; inline when small, closed or full."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"wrap takes a tensor, not {type(tensor).__name__}")
        nbytes = nbytes_of(tensor)
        if nbytes < self.inline_threshold:
            return WrappedFeature(encode_inline(tensor))
        lease = self._reserve(HEADER_BYTES + nbytes)
        if lease is None:
            return self._fallback(tensor)
        try:
            self._write(lease, tensor)
        except BaseException:
            with self._cond:
                self._writers -= 1
                if not self._closed:
                    self._alloc.free(lease.offset, lease.size)
                self._cond.notify_all()
            raise
        with self._cond:
            self._writers -= 1
            self._cond.notify_all()
            closed = self._closed
            if not closed:
                lease.deadline = time.monotonic() + self.ack_timeout
                self._live[lease.id] = lease
                self._counts["wrapped"] += 1
        if closed:  # closed while copying: the buffer is gone, the tensor is not
            return self._fallback(tensor)
        handle = base_fields(self.kind, tensor)
        handle.update(
            pool=self.pool_id,
            id=lease.id,
            offset=lease.offset + HEADER_BYTES,
            pid=os.getpid(),  # informational: which process owns the memory
            **self._handle_fields(),
        )
        return WrappedFeature(handle)

    def reap(self) -> int:
        """Free acknowledged and timed-out regions now; returns how many were freed."""
        freed = 0 if self._closed else self._drain_acks(force=True)
        with self._cond:
            return freed if self._closed else freed + self._reclaim_expired_locked()

    def close(self) -> None:
        """Free everything the pool owns (worker shutdown). Idempotent; later wraps go inline."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            deadline = time.monotonic() + _CLOSE_WAIT_S
            while self._writers and (remaining := deadline - time.monotonic()) > 0:
                self._cond.wait(remaining)
            for lease in self._live.values():
                self._invalidate(lease)
            self._live.clear()
            self._release()
        self._acks.discard(self.pool_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Capacity, bytes in use and the high-water mark, live regions and event counts."""
        with self._cond:
            return {
                "capacity_bytes": self._alloc.capacity,
                "used_bytes": self._alloc.used,
                "peak_bytes": self._alloc.peak,
                "live": len(self._live),
                "wrapped": self._counts["wrapped"],
                "acked": self._counts["acked"],
                "reclaimed": self._counts["reclaimed"],
                "inline_fallbacks": self._counts["inline_fallbacks"],
            }

    # --- internals ------------------------------------------------------------------------

    def _fallback(self, tensor: torch.Tensor) -> WrappedFeature:
        with self._cond:
            self._counts["inline_fallbacks"] += 1
        return WrappedFeature(encode_inline(tensor))

    def _reserve(self, size: int) -> _Lease | None:
        if size > self._alloc.capacity:
            return None
        deadline = time.monotonic() + self.wait_timeout
        force = True
        while True:
            self._drain_acks(force=force)
            force = False
            with self._cond:
                if self._closed:
                    return None
                self._reclaim_expired_locked()
                got = self._alloc.allocate(size)
                if got is not None:
                    self._writers += 1
                    return _Lease(new_feature_id(), *got)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                # Backpressure: sleep until a region is freed or it is time to drain acks again.
                self._cond.wait(min(remaining, _POLL_INTERVAL_S))

    def _drain_acks(self, *, force: bool) -> int:
        """Free the regions consumers acknowledged. The channel is never called under the pool lock,
        by one thread at a time (the others go on without), at most every poll interval
        unless forced, and not at all for a while after it failed, so an outage costs one
        client timeout now and then instead of stalling every wrap."""
        now = time.monotonic()
        if now < self._drain_paused_until or (not force and now - self._last_drain < _POLL_INTERVAL_S):
            return 0
        if not self._drain_lock.acquire(blocking=False):
            return 0
        try:
            self._last_drain = now
            ids = self._acks.drain(self.pool_id)
            if ids is None:
                self._drain_paused_until = time.monotonic() + _DRAIN_PAUSE_AFTER_ERROR_S
                return 0
        finally:
            self._drain_lock.release()
        freed = 0
        with self._cond:
            for feature_id in ids:
                lease = self._live.pop(feature_id, None)
                if lease is not None:  # unknown ids: already reclaimed, or a duplicate ack
                    self._free_locked(lease)
                    self._counts["acked"] += 1
                    freed += 1
            if freed:
                self._cond.notify_all()
        return freed

    def _reclaim_expired_locked(self) -> int:
        now = time.monotonic()
        freed = 0
        while self._live:
            feature_id, lease = next(iter(self._live.items()))
            if lease.deadline > now:
                break
            del self._live[feature_id]
            self._free_locked(lease)
            self._counts["reclaimed"] += 1
            freed += 1
        if freed:
            self._cond.notify_all()
        return freed

    def _free_locked(self, lease: _Lease) -> None:
        self._invalidate(lease)
        self._alloc.free(lease.offset, lease.size)
