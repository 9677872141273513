"""WrappedFeature, the inline codec, transport choice and the region allocator (in-process)."""

from __future__ import annotations

import copy
import json
import pickle
import random

import pytest
import torch
from transport_support import make_tensor

from engine.errors import TransportError
from engine.transport import (
    InlineTransport,
    WrappedFeature,
    WrappedFeatureAccessError,
    choose_transport,
    make_transport,
    open_feature,
)
from engine.transport.regions import RegionAllocator


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "float16", "bool", "uint8"])
def test_inline_round_trip_is_exact(dtype):
    tensor = make_tensor({"dtype": dtype, "shape": [7, 33], "seed": 3})
    wrapped = InlineTransport().wrap(tensor)
    handle = json.loads(json.dumps(wrapped.handle))  # JSON-safe, as it travels
    opened = open_feature(handle)
    assert opened.dtype == tensor.dtype and torch.equal(opened, tensor)
    assert handle["kind"] == "inline" and handle["shape"] == [7, 33]


def test_inline_handles_noncontiguous_and_scalar():
    tensor = make_tensor({"dtype": "float32", "shape": [5, 6], "seed": 1, "noncontiguous": True})
    assert torch.equal(open_feature(InlineTransport().wrap(tensor)), tensor)
    scalar = torch.tensor(2.5, dtype=torch.bfloat16)
    assert torch.equal(open_feature(InlineTransport().wrap(scalar)), scalar)


def _wrapped() -> WrappedFeature:
    return InlineTransport().wrap(torch.arange(12, dtype=torch.float32).reshape(3, 4))


@pytest.mark.parametrize(
    "touch",
    [
        lambda f: f[0],
        lambda f: f[1:],
        lambda f: f[:, 2],
        lambda f: len(f),
        lambda f: list(f),
        lambda f: f + 1,
        lambda f: 2 * f,
        lambda f: -f,
        lambda f: bool(f),
        lambda f: f.view(-1),
        lambda f: f.reshape(4, 3),
        lambda f: f.flatten(),
        lambda f: f.to("cpu"),
        lambda f: torch.cat([f, f]),
        lambda f: torch.nn.functional.pad(f, (1, 1)),
    ],
    ids=[
        "index",
        "slice",
        "column",
        "len",
        "iter",
        "add",
        "rmul",
        "neg",
        "bool",
        "view",
        "reshape",
        "flatten",
        "to",
        "torch.cat",
        "F.pad",
    ],
)
def test_wrapped_feature_refuses_tensor_access(touch):
    feature = _wrapped()
    with pytest.raises(WrappedFeatureAccessError, match="wrapped for transport") as info:
        touch(feature)
    assert isinstance(info.value, TransportError)
    assert info.value.code == "wrapped_feature_access"
    assert "open_feature" in info.value.message


def test_wrapped_feature_metadata_is_readable():
    feature = _wrapped()
    assert feature.kind == "inline"
    assert feature.shape == torch.Size([3, 4]) and feature.dtype == torch.float32
    assert feature.nbytes == 48
    assert "inline" in repr(feature)
    # Plain-object machinery keeps working: copies, pickling, equality by handle, hasattr.
    assert copy.deepcopy(feature) == feature
    assert pickle.loads(pickle.dumps(feature)) == feature
    assert not hasattr(feature, "_private_probe")


def test_open_feature_rejects_malformed_handles():
    with pytest.raises(TransportError):
        open_feature({"kind": "carrier-pigeon"})
    good = _wrapped().handle
    with pytest.raises(TransportError):
        open_feature({**good, "nbytes": 47})
    with pytest.raises(TransportError):
        open_feature({**good, "dtype": "not_a_dtype"})
    with pytest.raises(TransportError):
        open_feature({**good, "data": "!!not base64!!"})
    shm_handle = {
        "kind": "shm",
        "v": 1,
        "dtype": "float32",
        "shape": [4],
        "nbytes": 16,
        "pool": "p",
        "id": "00" * 8,
        "offset": 64,
        "segment": "../etc/passwd",
    }
    with pytest.raises(TransportError):
        open_feature(shm_handle)


@pytest.mark.parametrize(
    ("preferred", "cuda", "same_node", "expected"),
    [
        ("auto", True, True, "cuda_ipc"),
        ("auto", False, True, "shm"),
        ("auto", True, False, "inline"),
        ("shm", True, True, "shm"),
        ("inline", False, True, "inline"),
        ("cuda_ipc", True, True, "cuda_ipc"),
        ("cuda_ipc", True, False, "inline"),
    ],
)
def test_choose_transport(preferred, cuda, same_node, expected):
    assert choose_transport(preferred, cuda_available=cuda, same_node=same_node) == expected


def test_choose_transport_rejects_impossible_choices():
    with pytest.raises(ValueError):
        choose_transport("cuda_ipc", cuda_available=False)
    with pytest.raises(ValueError):
        choose_transport("smoke-signals", cuda_available=True)
    with pytest.raises(ValueError):
        make_transport("shm")  # a pool needs an AckChannel


def test_region_allocator_never_overlaps_and_coalesces():
    rng = random.Random(0)
    alloc = RegionAllocator(1 << 20, 64)
    live: list[tuple[int, int]] = []
    for _ in range(3000):
        if live and rng.random() < 0.5:
            alloc.free(*live.pop(rng.randrange(len(live))))
        else:
            got = alloc.allocate(rng.randrange(1, 64 * 1024))
            if got is not None:
                live.append(got)
        spans = sorted(live)
        assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert alloc.used == sum(size for _, size in live) <= alloc.capacity
        assert all(offset % 64 == 0 for offset, _ in live)
    for region in live:
        alloc.free(*region)
    assert alloc.used == 0 and alloc.largest_free == alloc.capacity
