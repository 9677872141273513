"""The shm pool's lifetimes in one process: acks, reclaim, backpressure, close, concurrency."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry
from transport_support import digest, make_tensor, shm_names

from domain.infra.transport_acks import RedisAckChannel
from engine.transport import (
    HandleUnavailableError,
    InlineTransport,
    ShmPool,
    TransportError,
    acknowledge,
    close_consumer_mappings,
    open_feature,
    opened,
)
from engine.transport import shm as shm_module
from engine.transport.pool import HEADER_BYTES

KIB = 1024


def _tensor(kib: int, seed: int = 0) -> torch.Tensor:
    return make_tensor({"dtype": "float32", "shape": [kib * KIB // 4], "seed": seed})


def _pool_for(acks, regions: int, kib: int, **options) -> ShmPool:
    """A pool with room for exactly ``regions`` tensors of ``kib`` KiB."""
    return ShmPool(acks, capacity_bytes=regions * (HEADER_BYTES + kib * KIB), **options)


def test_round_trip_ack_and_reuse(acks):
    with _pool_for(acks, 2, 256) as pool:
        x = _tensor(256)
        wrapped = pool.wrap(x)
        assert wrapped.kind == "shm" and len(json.dumps(wrapped.handle)) < 300
        assert torch.equal(open_feature(wrapped.handle), x)
        assert acknowledge(acks, [wrapped])
        assert pool.reap() == 1
        assert pool.stats()["used_bytes"] == 0
        with pytest.raises(HandleUnavailableError):
            open_feature(wrapped.handle)  # released: its region no longer holds this feature


def test_small_tensors_always_go_inline(acks):
    with _pool_for(acks, 2, 256) as pool:
        small = _tensor(16)
        wrapped = pool.wrap(small)
        assert wrapped.kind == "inline"
        assert torch.equal(open_feature(wrapped.handle), small)
        assert pool.stats()["used_bytes"] == 0 and pool.stats()["inline_fallbacks"] == 0


def test_full_pool_waits_then_falls_back_to_inline(acks):
    with _pool_for(acks, 1, 128, wait_timeout=0.2) as pool:
        x = _tensor(128)
        first = pool.wrap(x)
        assert first.kind == "shm"
        start = time.monotonic()
        second = pool.wrap(x)  # no ack comes: waits, then inline
        assert time.monotonic() - start >= 0.2
        assert second.kind == "inline" and torch.equal(open_feature(second.handle), x)
        assert pool.stats()["inline_fallbacks"] == 1

        pool.wait_timeout = 5.0
        timer = threading.Timer(0.1, acknowledge, args=(acks, [first]))
        timer.start()
        start = time.monotonic()
        third = pool.wrap(x)  # the ack arrives while waiting: backpressure, not fallback
        timer.join()
        assert third.kind == "shm" and time.monotonic() - start < 2.0
        assert torch.equal(open_feature(third.handle), x)


def test_oversized_tensor_goes_inline_without_waiting(acks):
    with _pool_for(acks, 1, 128, wait_timeout=5) as pool:
        start = time.monotonic()
        assert pool.wrap(_tensor(512)).kind == "inline"
        assert time.monotonic() - start < 1.0


def test_unacknowledged_region_is_reclaimed_and_stale_handle_fails(acks):
    with _pool_for(acks, 1, 128, ack_timeout=0.2) as pool:
        old = pool.wrap(_tensor(128, seed=1))
        time.sleep(0.3)
        assert pool.reap() == 1 and pool.stats()["reclaimed"] == 1
        with pytest.raises(HandleUnavailableError):
            open_feature(old.handle)
        new = pool.wrap(_tensor(128, seed=2))  # reuses the very same region
        assert new.handle["offset"] == old.handle["offset"]
        with pytest.raises(HandleUnavailableError):
            open_feature(old.handle)  # never another feature's bytes
        assert torch.equal(open_feature(new.handle), _tensor(128, seed=2))


def test_close_unlinks_the_segment(acks, redis_client):
    before = shm_names(os.getpid())
    pool = _pool_for(acks, 4, 128)
    handles = [pool.wrap(_tensor(128, seed=i)).handle for i in range(3)]
    assert shm_names(os.getpid()) - before == {pool.segment_name}
    assert torch.equal(open_feature(handles[0]), _tensor(128, seed=0))
    pool.close()
    pool.close()  # idempotent
    assert shm_names(os.getpid()) == before
    with pytest.raises(HandleUnavailableError):
        open_feature(handles[1])  # this process had the segment mapped: still noticed as gone
    assert pool.wrap(_tensor(128)).kind == "inline"  # a closed pool never fails a wrap
    assert not redis_client.exists(f"rq:transport:acks:{pool.pool_id}")


def test_pool_never_exceeds_its_cap_under_200_concurrent_wraps(acks, redis_client):
    """200 threads wrap at once; a slow consumer acks through Redis; the pool stays in bounds."""
    queue = f"rqt-test:concurrent:{uuid.uuid4().hex}"
    tensors = [_tensor(128, seed=i) for i in range(200)]
    expected = {i: digest(t) for i, t in enumerate(tensors)}
    pool = _pool_for(acks, 3, 128, wait_timeout=0.3, ack_timeout=30)
    segment_size = os.stat(f"/dev/shm/{pool.segment_name}").st_size
    consumed: dict[int, str] = {}
    errors: list[BaseException] = []

    def consumer():
        while True:
            _, raw = redis_client.blpop([queue], timeout=30)
            message = json.loads(raw)
            if message is None:
                return
            time.sleep(0.005)  # slow consumer
            consumed[message["i"]] = digest(open_feature(message["handle"]))
            acknowledge(acks, [message["handle"]])

    used_samples: list[int] = []
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            used_samples.append(pool.stats()["used_bytes"])
            time.sleep(0.001)

    results: dict[int, object] = {}
    barrier = threading.Barrier(200)

    def producer(i: int):
        try:
            barrier.wait()
            wrapped = pool.wrap(tensors[i])
            results[i] = wrapped
            if wrapped.kind == "shm":
                redis_client.rpush(queue, json.dumps({"i": i, "handle": wrapped.handle}))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=consumer), threading.Thread(target=sampler)]
    threads += [threading.Thread(target=producer, args=(i,)) for i in range(200)]
    with pool:
        for thread in threads:
            thread.start()
        for thread in threads[2:]:
            thread.join()
        redis_client.rpush(queue, json.dumps(None))
        threads[0].join()
        stop.set()
        threads[1].join()
        pool.reap()
        stats = pool.stats()
        assert os.stat(f"/dev/shm/{pool.segment_name}").st_size == segment_size

    assert not errors
    assert len(results) == 200
    assert stats["peak_bytes"] <= stats["capacity_bytes"]
    assert max(used_samples) <= stats["capacity_bytes"]
    kinds = [results[i].kind for i in range(200)]
    assert kinds.count("shm") == stats["wrapped"] == stats["acked"] > 3
    assert kinds.count("inline") == stats["inline_fallbacks"] > 0
    assert stats["live"] == 0 and stats["used_bytes"] == 0
    assert consumed == {i: expected[i] for i in range(200) if kinds[i] == "shm"}
    for i in range(200):
        if kinds[i] == "inline":
            assert digest(open_feature(results[i].handle)) == expected[i]


def test_pool_larger_than_dev_shm_is_refused_up_front(acks):
    before = shm_names(os.getpid())
    with pytest.raises(TransportError, match="/dev/shm"):
        ShmPool(acks, capacity_bytes=1 << 50)
    assert shm_names(os.getpid()) == before


def test_redis_outage_never_fails_wrap_or_ack():
    # Nothing listens on port 1; no client retries, so the test measures the pool, not redis-py.
    unreachable = RedisAckChannel(redis.Redis(port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)))
    start = time.monotonic()
    with _pool_for(unreachable, 1, 128, wait_timeout=0.1) as pool:
        x = _tensor(128)
        first = pool.wrap(x)  # acks cannot be drained: logged, the wrap goes on
        assert first.kind == "shm" and torch.equal(open_feature(first.handle), x)
        assert acknowledge(unreachable, [first]) is False  # lost ack: reclaimed on timeout instead
        assert pool.wrap(x).kind == "inline"
    assert acknowledge(unreachable, [InlineTransport().wrap(x)]) is True  # nothing to send
    assert time.monotonic() - start < 3.0  # failed drains pause instead of retrying on every poll


def test_opened_gives_zero_copy_views_and_acks_on_exit(acks):
    with _pool_for(acks, 2, 256) as pool:
        x, y = _tensor(256, seed=1), _tensor(256, seed=2)
        wrapped = [pool.wrap(x), pool.wrap(y)]
        with opened(acks, wrapped) as (a, b):
            assert torch.equal(a, x) and torch.equal(b, y)
            # Zero-copy: the view reads the segment, so it sees what the producer wrote.
            assert a.untyped_storage().nbytes() == pool.stats()["capacity_bytes"]
        assert pool.reap() == 2 and pool.stats()["acked"] == 2

        held = pool.wrap(x)  # the same, split in two calls as a worker that acks after its batch
        view = open_feature(held.handle, hold=True)
        assert torch.equal(view, x) and view.untyped_storage().nbytes() == pool.stats()["capacity_bytes"]
        del view
        acknowledge(acks, [held])
        assert pool.reap() == 1

        again = pool.wrap(x)
        with pytest.raises(RuntimeError, match="boom"), opened(acks, [again]):
            raise RuntimeError("boom")
        assert pool.reap() == 1  # acknowledged even though the block failed


def test_unmapping_waits_for_live_views(acks):
    with _pool_for(acks, 1, 256) as pool:
        x = _tensor(256)
        wrapped = pool.wrap(x)
        with opened(acks, [wrapped]) as [view]:
            close_consumer_mappings()  # must not unmap under a live view
            assert torch.equal(view, x)
        del view
        close_consumer_mappings()
        assert not shm_module._deferred and not shm_module._mappings
