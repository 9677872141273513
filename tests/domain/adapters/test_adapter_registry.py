"""The adapter registry in Redis (#58 item 3): scopes per key and shared, versions never given
twice, a put-back only over the version it refused, the workers' reports."""

from __future__ import annotations

import pytest

from domain.adapters.store import ENTRIES_KEY, EPOCH_KEY, SEQ_KEY, SHARED, AdapterRegistry, WorkerAdapters


@pytest.fixture
def registry(redis_client):
    redis_client.delete(ENTRIES_KEY, EPOCH_KEY, SEQ_KEY)
    for key in redis_client.scan_iter(match="rq:lora:worker:*"):
        redis_client.delete(key)
    return AdapterRegistry(redis_client)


def test_a_key_sees_its_own_and_the_shared_ones_its_own_first(registry):
    registry.put(scope="key-a", name="tuned", path="/w/a")
    registry.put(scope="key-b", name="tuned", path="/w/b")
    registry.put(scope=SHARED, name="tuned", path="/w/shared")
    registry.put(scope=SHARED, name="common", path="/w/common")
    assert registry.resolve("key-a", "tuned").path == "/w/a"
    assert registry.resolve("key-b", "tuned").path == "/w/b"
    assert registry.resolve("key-c", "tuned").path == "/w/shared"
    assert registry.resolve("key-c", "missing") is None
    assert [(e.name, e.scope) for e in registry.visible("key-a")] == [("common", SHARED), ("tuned", "key-a"),
                                                                      ("tuned", SHARED)]
    assert registry.count("key-a") == 1 and registry.count(SHARED) == 2


def test_versions_are_never_given_twice_and_each_change_moves_the_epoch(registry):
    first, previous, epoch = registry.put(scope="k", name="x", path="/w/1")
    assert previous is None and epoch == 1
    second, previous, epoch = registry.put(scope="k", name="x", path="/w/2")
    assert previous == first and second.version > first.version and epoch == 2
    assert registry.remove("k", "x") == second and registry.epoch() == 3
    assert registry.remove("k", "x") is None and registry.epoch() == 3
    third, _, _ = registry.put(scope="k", name="x", path="/w/1")
    assert third.id not in (first.id, second.id), "an engine id names one adapter's weights, for good"


def test_a_put_back_restores_only_over_the_version_it_refused(registry):
    first, _, _ = registry.put(scope="k", name="x", path="/w/good")
    refused, previous, _ = registry.put(scope="k", name="x", path="/w/bad")
    registry.put_back(refused, previous)
    assert registry.get("k", "x") == first
    newer, _, _ = registry.put(scope="k", name="x", path="/w/newer")
    registry.put_back(refused, previous)  # late: a newer version stands
    assert registry.get("k", "x") == newer
    fresh, none, _ = registry.put(scope="k", name="y", path="/w/bad")
    registry.put_back(fresh, none)
    assert registry.get("k", "y") is None


def test_workers_report_with_a_ttl(registry, redis_client):
    registry.report(WorkerAdapters("gpu-1", 4, ["k/x@1"], {"k/y@2": {"code": "adapter_invalid", "message": "no"}}))
    [worker] = registry.workers()
    assert worker.epoch == 4 and worker.ids == ["k/x@1"] and "k/y@2" in worker.refused
    assert 0 < redis_client.ttl("rq:lora:worker:gpu-1") <= 6
