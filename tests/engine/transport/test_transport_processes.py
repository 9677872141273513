"""Producer and consumer in unrelated processes (separate interpreters, not forks): handles
travel through Redis only."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from transport_support import digest, make_tensor, shm_names

POOL = {"kind": "shm", "capacity_bytes": 8 << 20, "ack_timeout": 30, "wait_timeout": 5}
SPECS = {
    "float32": {"dtype": "float32", "shape": [256, 1024]},
    "bfloat16": {"dtype": "bfloat16", "shape": [300, 400]},
    "int64": {"dtype": "int64", "shape": [100, 1000]},
    "bool": {"dtype": "bool", "shape": [512, 300]},
    "noncontiguous": {"dtype": "float32", "shape": [128, 512], "noncontiguous": True},
    "tiny-inline": {"dtype": "float32", "shape": [3, 5]},
}


def _queue() -> str:
    return f"rqt-test:handles:{uuid.uuid4().hex}"


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def shm_pair(agents):
    producer, consumer = agents
    producer.call("pool", **POOL)
    yield producer, consumer
    producer.call("close")


@pytest.mark.parametrize("name", list(SPECS))
def test_round_trip_between_unrelated_processes(shm_pair, name):
    producer, consumer = shm_pair
    specs = [{**SPECS[name], "seed": seed} for seed in range(3)]
    queue = _queue()
    kinds = producer.call("produce", queue=queue, specs=specs)["kinds"]
    results = consumer.call("consume", queue=queue, count=len(specs))
    assert [r.get("digest") for r in results] == [digest(make_tensor(s)) for s in specs]
    assert kinds == ["inline" if name == "tiny-inline" else "shm"] * 3
    assert producer.call("reap") >= 0
    stats = producer.call("stats")
    assert stats["live"] == 0 and stats["used_bytes"] == 0  # every ack reached the producer


def test_killed_producer_handle_is_unavailable(agents, spawn_agent):
    """SIGKILL the producer: its resource tracker (a separate process) unlinks the segment, and
    the consumer gets HandleUnavailableError (the caller re-preprocesses)."""
    _, consumer = agents
    victim = spawn_agent("victim")
    victim.wait_ready()
    segment = victim.call("pool", **POOL)["segment"]
    queue = _queue()
    victim.call("produce", queue=queue, specs=[{**SPECS["float32"], "seed": 9}])
    assert segment in shm_names()
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    assert _wait_until(lambda: segment not in shm_names()), "the tracker did not unlink it"
    [result] = consumer.call("consume", queue=queue, count=1)
    assert result == {"error": "handle_unavailable"}


def test_sweep_removes_segments_of_a_producer_killed_with_its_tracker(agents, spawn_agent):
    """If the producer's tracker dies too (whole group killed), the segment stays until
    sweep_orphaned_segments runs; after that the handle is unavailable. Until the sweep a
    consumer may still read the intact bytes: that is not guaranteed either way."""
    producer, consumer = agents
    live_segment = producer.call("pool", **POOL)["segment"]
    victim = spawn_agent("victim-group")
    victim.wait_ready()
    segment = victim.call("pool", **POOL)["segment"]
    queue = _queue()
    victim.call("produce", queue=queue, specs=[{**SPECS["float32"], "seed": 10}])
    tracker_pid = victim.call("info")["tracker_pid"]
    os.kill(tracker_pid, signal.SIGKILL)
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    time.sleep(0.2)
    assert segment in shm_names()  # nobody left to unlink it
    assert segment in consumer.call("sweep")
    assert segment not in shm_names() and live_segment in shm_names()  # live producers untouched
    [result] = consumer.call("consume", queue=queue, count=1)
    assert result == {"error": "handle_unavailable"}
    producer.call("close")


def test_soak_1000_cycles_leaves_nothing_but_the_pool(agents):
    producer, consumer = agents
    mine = (producer.proc.pid, consumer.proc.pid)
    before = {pid: shm_names(pid) for pid in mine}
    segment = producer.call("pool", kind="shm", capacity_bytes=2 << 20, ack_timeout=30, wait_timeout=10)[
        "segment"
    ]
    specs = [{"dtype": "float32", "shape": [64, 1024], "seed": seed} for seed in range(1000)]
    queue = _queue()
    # Both run at once: the producer wraps ahead until the pool is full, then waits for acks.
    consumer.send("consume", queue=queue, count=len(specs), timeout=60)
    kinds = producer.call("produce", queue=queue, specs=specs, timeout=120)["kinds"]
    results = consumer.reply(timeout=120)
    assert kinds == ["shm"] * 1000
    assert [r["digest"] for r in results] == [digest(make_tensor(s)) for s in specs]
    # One segment for the whole pool; the consumer never creates any.
    assert shm_names(producer.proc.pid) - before[producer.proc.pid] == {segment}
    assert shm_names(consumer.proc.pid) == before[consumer.proc.pid]
    producer.call("reap")
    stats = producer.call("stats")
    assert stats["wrapped"] == stats["acked"] == 1000 and stats["inline_fallbacks"] == 0
    assert stats["live"] == 0 and stats["peak_bytes"] <= 2 << 20
    producer.call("close")
    assert {pid: shm_names(pid) for pid in mine} == before
