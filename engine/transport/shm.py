"""``shm``: features in a POSIX shared-memory segment owned by the producer's pool.

Producer: one segment per pool (``rqt_<pid>_<pool_id>``), created at pool start and unlinked by
``close()``. The pool keeps the creator's resource-tracker registration on purpose: if the
producer dies without closing (even by SIGKILL), its tracker process unlinks the segment, so a
crashed worker leaves nothing in /dev/shm. If the tracker dies too (the whole process group was
killed), ``sweep_orphaned_segments`` removes segments whose producer pid is gone.

Consumer: attaches by name, zero-copy (``torch.frombuffer``), and copies the feature out, so the
producer may reuse the region as soon as the consumer acks; or, with ``hold=True`` (``opened``),
uses the view itself until it acks, which saves the copy. The attachment is cached per
segment (a pool is one segment, so a consumer maps each producer once). On Python < 3.13
attaching also registers the segment with the consumer's resource tracker, which would unlink
the producer's segment when the consumer exits; the consumer unregisters it right away, so
exactly one owner, the producer pool, ever unlinks.

A handle is unavailable (``HandleUnavailableError``) when the segment is gone (producer closed
or died) or the region no longer holds the handle's feature id (acked or reclaimed).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections import OrderedDict
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import torch

from engine.errors import HandleUnavailableError, TransportError

from .ack_channel import AckChannel
from .codec import field, layout, nbytes_of
from .pool import HEADER_BYTES, ID_BYTES, RegionPool, _Lease

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "rqt_"
# Where Linux exposes POSIX shared memory: used to notice unlinked segments and for the sweep.
_SHM_DIR = Path("/dev/shm")
_HAS_SHM_DIR = _SHM_DIR.is_dir()
# Consumers map at most this many producers' segments at once (least recently used go first).
_MAX_MAPPINGS = 16

# Segments created by pools of this process: attaching to one of them must not unregister it
# from the tracker, since the tracker's registration is the pool's crash cleanup.
_OWNED: set[str] = set()


class ShmPool(RegionPool):
    """Producer-owned bounded pool in one shared-memory segment of ``capacity_bytes``."""

    kind = "shm"

    def __init__(self, acks: AckChannel, *, capacity_bytes: int, **options: Any):
        super().__init__(acks, capacity_bytes=capacity_bytes, **options)
        self.segment_name = f"{SEGMENT_PREFIX}{os.getpid()}_{self.pool_id}"
        size = self._alloc.capacity
        if _HAS_SHM_DIR and (free := _free_shm_bytes()) < size:
            raise TransportError(
                f"a {size}-byte shm pool does not fit in /dev/shm ({free} bytes free); lower the pool "
                "capacity or enlarge /dev/shm (docker run --shm-size)"
            )
        self._segment = SharedMemory(name=self.segment_name, create=True, size=size)
        try:
            _reserve(self._segment, size)
        except OSError as exc:
            self._segment.close()
            self._segment.unlink()
            raise TransportError(f"could not reserve {size} bytes of shared memory: {exc}") from exc
        _OWNED.add(self.segment_name)
        self._base: torch.Tensor | None = _as_tensor(self._segment)

    def _write(self, lease: _Lease, tensor: torch.Tensor) -> None:
        start = lease.offset + HEADER_BYTES
        region = self._base[start : start + nbytes_of(tensor)]
        # copy_ handles strides and devices; detach keeps autograd out of the shared buffer.
        region.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        self._segment.buf[lease.offset : lease.offset + ID_BYTES] = bytes.fromhex(lease.id)

    def _invalidate(self, lease: _Lease) -> None:
        self._segment.buf[lease.offset : lease.offset + ID_BYTES] = bytes(ID_BYTES)

    def _handle_fields(self) -> dict[str, Any]:
        return {"segment": self.segment_name}

    def _release(self) -> None:
        self._base = None  # it pins the mapping; drop it before closing
        try:
            self._segment.close()
        except BufferError:
            log.warning("a view of pool %s is still alive; its mapping stays until exit", self.pool_id)
        try:
            self._segment.unlink()  # also unregisters it from this process's resource tracker
        except FileNotFoundError:
            pass  # already swept
        _OWNED.discard(self.segment_name)


def _as_tensor(segment: SharedMemory) -> torch.Tensor:
    # torch.frombuffer keeps a reference to the object it is given but holds no buffer export,
    # so a tensor over ``segment.buf`` itself would not stop close() from unmapping the memory
    # under it (a segfault on the next read). A memoryview of its own pins the mmap's export:
    # while any tensor over the segment lives, close() raises BufferError instead.
    return torch.frombuffer(memoryview(segment.buf), dtype=torch.uint8)


def _free_shm_bytes() -> int:
    stat = os.statvfs(_SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def _reserve(segment: SharedMemory, size: int) -> None:
    # tmpfs hands out pages on first touch; when /dev/shm fills up, touching one raises SIGBUS
    # in the producer. Reserving the whole pool now turns that into ENOSPC at start-up (and spares
    # the page faults on first use). SharedMemory has no public accessor for its descriptor.
    fd = getattr(segment, "_fd", -1)
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)


# --- consumer ---------------------------------------------------------------------------------

_lock = threading.Lock()
_mappings: OrderedDict[str, tuple[SharedMemory, torch.Tensor]] = OrderedDict()
# Evicted segments that live views still use; closed at a later eviction once the views are gone.
_deferred: list[SharedMemory] = []


def open_shm(handle: dict[str, Any], *, device: Any = None, hold: bool = False) -> torch.Tensor:
    """A private copy of the feature (on ``device``, default CPU); ack the handle afterwards.

    ``hold=True`` returns a zero-copy CPU view of the segment instead, valid until the handle is
    acknowledged; it keeps this process's mapping alive while it exists.
    """
    dtype, shape, nbytes = layout(handle)
    name = field(handle, "segment", str)
    offset = field(handle, "offset", int)
    try:
        expected = bytes.fromhex(field(handle, "id", str))
    except ValueError:
        expected = b""
    if not name.startswith(SEGMENT_PREFIX) or "/" in name or len(expected) != ID_BYTES:
        raise TransportError("malformed shm feature handle")
    header = slice(offset - HEADER_BYTES, offset - HEADER_BYTES + ID_BYTES)
    with _lock:  # the mapping cache is shared by the consumer's threads
        segment, base = _mapping(name)
        if offset < HEADER_BYTES or offset + nbytes > base.numel():
            raise TransportError("shm feature handle points outside its segment")
        if bytes(segment.buf[header]) != expected:
            raise HandleUnavailableError("shared-memory feature was released or reclaimed")
        region = base[offset : offset + nbytes].view(dtype).view(shape)
        if hold and (device is None or torch.device(device).type == "cpu"):
            return region
        out = torch.empty(shape, dtype=dtype, device=device or "cpu")
        out.copy_(region)
        del region
        # Re-check: a region reclaimed while we copied may hold another feature's bytes now.
        if bytes(segment.buf[header]) != expected:
            raise HandleUnavailableError("shared-memory feature was reclaimed while being read")
    return out


def close_consumer_mappings() -> None:
    """Unmap every cached producer segment (worker shutdown, tests; also run at exit)."""
    with _lock:
        while _mappings:
            _evict(next(iter(_mappings)))
        _close_deferred()


# At interpreter exit, before objects are torn down in arbitrary order (SharedMemory.__del__
# would otherwise try to close mappings our tensors still pin, and complain).
atexit.register(close_consumer_mappings)


def sweep_orphaned_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink this service's segments whose producer process is gone; returns their names.

    Only for crashes that took the producer's resource tracker down too. Run it where the
    producers' pids are visible (same pid namespace): a pid that does not exist here is taken
    for a dead producer. A zombie (killed, not yet reaped) still counts as alive.
    """
    removed: list[str] = []
    if not _HAS_SHM_DIR:
        return removed
    for path in _SHM_DIR.glob(f"{prefix}*"):
        pid_text = path.name[len(prefix) :].split("_", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        # Unlinked as a file (what shm_unlink does on Linux), never attached: a producer killed
        # between creating a segment and sizing it leaves an empty one, which cannot be mapped.
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # another sweep took it
        except OSError as error:
            log.warning("cannot remove the orphaned segment %s: %s", path.name, error)
            continue
        removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _mapping(name: str) -> tuple[SharedMemory, torch.Tensor]:
    if name in _mappings:
        if _HAS_SHM_DIR and not (_SHM_DIR / name).exists():
            # Unlinked by its producer (closed or died); our mapping only pins stale memory.
            _evict(name)
            raise HandleUnavailableError("the producer's shared-memory segment is gone")
        _mappings.move_to_end(name)
        return _mappings[name]
    try:
        segment = _attach(name)
    except FileNotFoundError as exc:
        raise HandleUnavailableError("the producer's shared-memory segment is gone") from exc
    entry = (segment, _as_tensor(segment))
    _mappings[name] = entry
    while len(_mappings) > _MAX_MAPPINGS:
        _evict(next(iter(_mappings)))
    return entry


def _attach(name: str) -> SharedMemory:
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    segment = SharedMemory(name=name)
    if name not in _OWNED:
        # Python < 3.13 tracks attached segments as if this process owned them.
        resource_tracker.unregister(segment._name, "shared_memory")
    return segment


def _evict(name: str) -> None:
    segment, base = _mappings.pop(name)
    del base
    _deferred.append(segment)
    _close_deferred()


def _close_deferred() -> None:
    _deferred[:] = [seg for seg in _deferred if not _try_close(seg)]


def _try_close(segment: SharedMemory) -> bool:
    try:
        segment.close()
    except BufferError:
        return False  # views from ``opened`` still read it: unmapping now would pull the rug
    return True
