"""Feature transport within a node: how finalized items' tensors reach the GPU worker.

The finalize step wraps each feature tensor, last (docs/architecture.md, "Finalize wraps last"); the wrapped feature is an opaque
:class:`WrappedFeature` whose JSON-safe ``handle`` travels with the Celery task. The GPU worker
opens handles with :func:`open_feature` and acknowledges them with :func:`acknowledge`.

Producer::

    kind = choose_transport(settings_value, cuda_available=torch.cuda.is_available())
    transport = make_transport(kind, acks=ack_channel, capacity_bytes=..., ack_timeout=...)
    item.features = {name: transport.wrap(t) for name, t in item.features.items()}
    ...
    transport.close()  # worker shutdown: unlinks / frees everything the pool owns

Consumer::

    tensors = {name: open_feature(wf.handle) for name, wf in item.features.items()}
    ...  # use them (cuda_ipc: zero-copy views, valid until acknowledged)
    acknowledge(ack_channel, item.features.values())

    # or zero-copy while held (shm too), acknowledged when the block ends:
    with opened(ack_channel, item.features.values()) as tensors:
        ...

Kinds:

- ``inline``: safetensors bytes in the handle. Across nodes, below ``inline_threshold``
  (64 KiB), and whenever a pool is full after ``wait_timeout`` or closed.
- ``shm``: one POSIX shared-memory segment per producer pool (:class:`ShmPool`).
- ``cuda_ipc``: one CUDA allocation per producer pool, shared by IPC handle (:class:`CudaIpcPool`).

Handles (every kind: ``kind``, ``v`` = 1, ``dtype`` like ``"bfloat16"``, ``shape``, ``nbytes``)::

    inline   + data: base64 of a safetensors file holding the tensor
    shm      + pool, id (16 hex), offset (of the data in the segment), pid, segment (name)
    cuda_ipc + pool, id, offset, pid, ipc: {device, numel, handle, storage_cls, storage_bytes,
               storage_offset, ref_counter, ref_counter_offset, event, event_sync}  (bytes base64)

Acknowledgements travel on an :class:`AckChannel` (``ack_channel.py``), a protocol the engine
defines and the domain implements with Redis (``domain/infra/transport_acks.py``); the engine
knows no broker.

Lifetimes: a pool owns a fixed buffer of ``capacity_bytes``; a region is freed by the
consumer's ack or after ``ack_timeout``. A handle
whose memory is gone raises :class:`~engine.errors.HandleUnavailableError` (retryable:
re-preprocess); touching a wrapped feature like a tensor raises
:class:`~engine.errors.WrappedFeatureAccessError`.
"""

from engine.errors import HandleUnavailableError, TransportError, WrappedFeatureAccessError

from .ack_channel import AckChannel
from .acks import acknowledge
from .choose import KINDS, FeatureTransport, choose_transport, make_transport
from .consumer import close_consumer_mappings, open_feature, opened
from .cuda_ipc import CudaIpcPool
from .inline import InlineTransport
from .pool import DEFAULT_INLINE_THRESHOLD, RegionPool
from .shm import SEGMENT_PREFIX, ShmPool, sweep_orphaned_segments
from .wrapped import WrappedFeature

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "AckChannel",
    "KINDS",
    "SEGMENT_PREFIX",
    "CudaIpcPool",
    "FeatureTransport",
    "HandleUnavailableError",
    "InlineTransport",
    "RegionPool",
    "ShmPool",
    "TransportError",
    "WrappedFeature",
    "WrappedFeatureAccessError",
    "acknowledge",
    "choose_transport",
    "close_consumer_mappings",
    "make_transport",
    "open_feature",
    "opened",
    "sweep_orphaned_segments",
]
