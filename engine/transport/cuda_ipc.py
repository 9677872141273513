"""``cuda_ipc``: features in one CUDA allocation per producer pool, opened by CUDA IPC handle.

Producer: the pool allocates its buffer on the node's GPU once and shares it once with
``torch.multiprocessing.reductions.reduce_tensor``; every feature handle carries that share
(bytes as base64) plus the feature's offset. Each wrap copies the tensor into a region and
synchronizes the stream before the handle exists, because a consumer that already opened the
buffer does not wait on the share's IPC event again.

Consumer: the first handle of a pool opens the buffer with ``rebuild_cuda_tensor`` (an uncached
``cudaIpcOpenMemHandle`` costs ~9 ms) and keeps it, so later features of that producer are
slices of an already-open mapping. ``open`` returns a zero-copy view on the pool's device: it
stays valid until the consumer acks (``acknowledge`` synchronizes the stream first), or until
the producer reclaims the region after ``ack_timeout`` — set that above the longest time a
consumer holds features.

Limits: producer and consumer must see the GPU under the same index (same
``CUDA_VISIBLE_DEVICES``); expandable segments in the CUDA allocator are not supported. torch
counts each share's consumers in a ref counter; several consumer processes opening one pool
decrement that single share more than once, so after the producer closes the pool the buffer
may stay in torch's "limbo" until the producer process exits (it is a worker shutdown anyway).

This module imports on machines without CUDA; constructing a pool there raises TransportError.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections import OrderedDict
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from engine.errors import HandleUnavailableError, TransportError

from .ack_channel import AckChannel
from .codec import field, layout, nbytes_of
from .pool import HEADER_BYTES, ID_BYTES, RegionPool, _Lease

# 512-byte aligned regions: whole memory transactions for every dtype.
_ALIGN = 512
# Consumers keep at most this many producers' buffers open (least recently used go first).
_MAX_OPEN_POOLS = 8
# The storage classes torch's rebuild may be given; a handle names one of these, never a path.
_STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}

# Buffers of pools living in this process: a process cannot IPC-open its own allocation.
_LOCAL: dict[str, torch.Tensor] = {}


class CudaIpcPool(RegionPool):
    """Producer-owned bounded pool in one CUDA allocation of ``capacity_bytes``."""

    kind = "cuda_ipc"
    align = _ALIGN

    def __init__(self, acks: AckChannel, *, capacity_bytes: int, device: Any = None, **options: Any):
        if not torch.cuda.is_available():
            raise TransportError("the cuda_ipc transport needs CUDA, which is not available here")
        super().__init__(acks, capacity_bytes=capacity_bytes, **options)
        self.device = _cuda_device(device)
        self._buffer: torch.Tensor | None = torch.empty(
            self._alloc.capacity, dtype=torch.uint8, device=self.device
        )
        _rebuild, args = reduce_tensor(self._buffer)
        self._ipc = _encode_share(args)
        _LOCAL[self.pool_id] = self._buffer

    def _write(self, lease: _Lease, tensor: torch.Tensor) -> None:
        start = lease.offset + HEADER_BYTES
        feature_id = torch.frombuffer(bytearray.fromhex(lease.id), dtype=torch.uint8)
        with torch.cuda.device(self.device):
            region = self._buffer[start : start + nbytes_of(tensor)]
            region.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            self._buffer[lease.offset : lease.offset + ID_BYTES].copy_(feature_id)
            torch.cuda.current_stream(self.device).synchronize()

    def _invalidate(self, lease: _Lease) -> None:
        with torch.cuda.device(self.device):
            self._buffer[lease.offset : lease.offset + ID_BYTES].zero_()

    def _handle_fields(self) -> dict[str, Any]:
        return {"ipc": self._ipc}

    def _release(self) -> None:
        _LOCAL.pop(self.pool_id, None)
        self._buffer = None


# --- consumer ---------------------------------------------------------------------------------

_lock = threading.Lock()
_opened: OrderedDict[str, tuple[str, torch.Tensor]] = OrderedDict()  # pool id -> (share, buffer)


def open_cuda_ipc(handle: dict[str, Any], *, device: Any = None, hold: bool = False) -> torch.Tensor:
    """The feature as a zero-copy view on the producer's GPU (valid until acked), or a copy
    when ``device`` names another device (e.g. ``"cpu"``). ``hold`` changes nothing here: on its
    own device it is always the zero-copy view, as the consumer holds features until it acks."""
    dtype, shape, nbytes = layout(handle)
    pool_id = field(handle, "pool", str)
    offset = field(handle, "offset", int)
    ipc = field(handle, "ipc", dict)
    try:
        expected = bytes.fromhex(field(handle, "id", str))
    except ValueError:
        expected = b""
    if len(expected) != ID_BYTES:
        raise TransportError("malformed cuda_ipc feature handle")
    with _lock:
        buffer = _pool_buffer(pool_id, ipc)
    if offset < HEADER_BYTES or offset + nbytes > buffer.numel():
        raise TransportError("cuda_ipc feature handle points outside its pool")
    header = buffer[offset - HEADER_BYTES : offset - HEADER_BYTES + ID_BYTES]
    if bytes(header.cpu().numpy()) != expected:
        raise HandleUnavailableError("CUDA feature was released or reclaimed")
    region = buffer[offset : offset + nbytes].view(dtype).view(shape)
    target = buffer.device if device is None else _resolve(device)
    if target == buffer.device:
        return region
    out = region.to(target, copy=True)
    if bytes(header.cpu().numpy()) != expected:
        raise HandleUnavailableError("CUDA feature was reclaimed while being read")
    return out


def close_consumer_mappings() -> None:
    """Drop every cached producer buffer (worker shutdown, tests)."""
    with _lock:
        _opened.clear()


def _pool_buffer(pool_id: str, ipc: dict[str, Any]) -> torch.Tensor:
    local = _LOCAL.get(pool_id)
    if local is not None:
        return local
    share = field(ipc, "handle", str)
    cached = _opened.get(pool_id)
    if cached is not None and cached[0] == share:
        _opened.move_to_end(pool_id)
        return cached[1]
    if not torch.cuda.is_available():
        raise HandleUnavailableError("a cuda_ipc feature cannot be opened without CUDA")
    try:
        args = _decode_share(ipc)
    except (binascii.Error, KeyError, TypeError, ValueError) as exc:
        raise TransportError("malformed cuda_ipc feature handle") from exc
    try:
        buffer = rebuild_cuda_tensor(*args)
    except RuntimeError as exc:  # the allocation or its ref counter is gone: producer died
        raise HandleUnavailableError("could not open the producer's CUDA memory") from exc
    _opened[pool_id] = (share, buffer)
    while len(_opened) > _MAX_OPEN_POOLS:
        _opened.popitem(last=False)
    return buffer


def _cuda_device(device: Any) -> torch.device:
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        raise ValueError(f"cuda_ipc needs a CUDA device, not {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _resolve(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# reduce_tensor's rebuild arguments for a CUDA tensor (torch.multiprocessing.reductions):
# (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size_bytes,
#  storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
#  event_sync_required). Bytes travel as base64, classes by allow-listed name.
_SHARE_ARITY = 15


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text, validate=True)


def _encode_share(args: tuple) -> dict[str, Any]:
    if len(args) != _SHARE_ARITY:
        raise TransportError(f"unsupported torch CUDA IPC format ({len(args)} rebuild arguments)")
    (
        _cls,
        size,
        _stride,
        _offset,
        storage_cls,
        _dtype,
        device,
        handle,
        storage_bytes,
        storage_offset,
        _grad,
        ref_counter,
        ref_counter_offset,
        event,
        event_sync,
    ) = args
    if storage_cls.__name__ not in _STORAGE_CLASSES:
        raise TransportError(f"unsupported torch storage class {storage_cls.__name__}")
    return {
        "device": int(device),
        "numel": int(size[0]),
        "handle": _b64(handle),
        "storage_cls": storage_cls.__name__,
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref_counter": _b64(ref_counter),
        "ref_counter_offset": int(ref_counter_offset),
        "event": _b64(event),
        "event_sync": bool(event_sync),
    }


def _decode_share(ipc: dict[str, Any]) -> tuple:
    numel = int(ipc["numel"])
    return (
        torch.Tensor,
        (numel,),
        (1,),
        0,
        _STORAGE_CLASSES[ipc["storage_cls"]],
        torch.uint8,
        int(ipc["device"]),
        _unb64(ipc["handle"]),
        int(ipc["storage_bytes"]),
        int(ipc["storage_offset"]),
        False,
        _unb64(ipc["ref_counter"]),
        int(ipc["ref_counter_offset"]),
        _unb64(ipc["event"]),
        bool(ipc["event_sync"]),
    )
