"""cuda_ipc: selectable off without CUDA; on a GPU node, a round trip between unrelated processes."""

from __future__ import annotations

import json
import statistics
import uuid

import pytest
import torch
from transport_support import digest, make_tensor

from engine.transport import (
    CudaIpcPool,
    HandleUnavailableError,
    TransportError,
    acknowledge,
    cuda_ipc,
    open_feature,
)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
MIB = 1 << 20


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_cuda_pool_is_refused_cleanly_without_cuda(acks):
    with pytest.raises(TransportError, match="CUDA"):
        CudaIpcPool(acks, capacity_bytes=MIB)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_cuda_handle_cannot_be_opened_without_cuda():
    handle = {
        "kind": "cuda_ipc",
        "v": 1,
        "dtype": "float32",
        "shape": [4],
        "nbytes": 16,
        "pool": "abc",
        "id": "01" * 8,
        "offset": 64,
        "pid": 1,
        "ipc": {"device": 0, "numel": 1024, "handle": "AA=="},
    }
    with pytest.raises(HandleUnavailableError):
        open_feature(handle)


def test_ipc_share_survives_json():
    """reduce_tensor's rebuild arguments (bytes, ints, classes) travel as JSON and come back."""
    args = (
        torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0,
        b"\x01" * 64, 4096, 512, False, b"/torch_123_456_0", 7, b"\x02" * 64, True,
    )  # fmt: skip
    share = json.loads(json.dumps(cuda_ipc._encode_share(args)))
    rebuilt = cuda_ipc._decode_share(share)
    assert rebuilt[1] == (4096,) and rebuilt[4] is torch.storage.TypedStorage
    assert rebuilt[6:] == args[6:]
    with pytest.raises(TransportError):
        cuda_ipc._encode_share(args[:-1])  # a torch whose format changed is refused, not guessed


@pytest.mark.gpu
@needs_cuda
def test_cuda_ipc_round_trip_22mib_between_unrelated_processes(agents):
    producer, consumer = agents
    producer.call("pool", kind="cuda_ipc", capacity_bytes=128 * MIB, ack_timeout=60, wait_timeout=10)
    specs = [{"dtype": "float32", "shape": [22 * MIB // 4], "seed": seed} for seed in range(8)]
    queue = f"rqt-test:cuda:{uuid.uuid4().hex}"
    consumer.send("consume", queue=queue, count=len(specs), timeout=120)
    kinds = producer.call("produce", queue=queue, specs=specs, timeout=120)["kinds"]
    results = consumer.reply(timeout=180)
    assert kinds == ["cuda_ipc"] * len(specs)
    assert [r["digest"] for r in results] == [digest(make_tensor(s)) for s in specs]
    assert all(r["device"].startswith("cuda") for r in results)
    # The first open maps the producer's pool (cudaIpcOpenMemHandle, plus CUDA init here);
    # the rest are slices of the cached mapping and a header check.
    cached_ms = statistics.median(r["open_ms"] for r in results[1:])
    assert cached_ms < 2.0, (results[0]["open_ms"], cached_ms)
    producer.call("reap")
    assert producer.call("stats")["live"] == 0
    producer.call("close")


@pytest.mark.gpu
@needs_cuda
def test_cuda_ipc_pool_in_one_process(acks):
    x = make_tensor({"dtype": "bfloat16", "shape": [512, 1024], "seed": 4})
    with CudaIpcPool(acks, capacity_bytes=8 * MIB, ack_timeout=60) as pool:
        wrapped = pool.wrap(x)
        assert wrapped.kind == "cuda_ipc"
        opened = open_feature(wrapped.handle)
        assert opened.is_cuda and torch.equal(opened.cpu(), x)
        assert torch.equal(open_feature(wrapped.handle, device="cpu"), x)
        del opened
        acknowledge(acks, [wrapped])
        assert pool.reap() == 1
        with pytest.raises(HandleUnavailableError):
            open_feature(wrapped.handle)
