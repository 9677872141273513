"""WeightSync (a GPU worker's side of weight updates) and the fleet update call, against a real
Redis and a real tiny model: no Celery here, the batch loop is played by the test."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import redis

from domain.weights.store import WeightStore
from domain.weights.updates import WeightsRefusedError, fleet_paused, update_weights
from engine.demo_model import build_demo_model
from engine.errors import Fault
from engine.generation import Engine
from engine.loading import load_model
from tests.conftest import empty_db_url
from workers.gpu.weight_sync import WeightSync


@pytest.fixture
def store(redis_url):
    client = redis.Redis.from_url(empty_db_url(redis_url, 16))
    yield WeightStore(client)
    client.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights-root")
    build_demo_model(root / "step-1", seed=1)
    build_demo_model(root / "step-2", seed=2)
    bad = root / "bad"
    build_demo_model(bad, seed=3)
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    return root


@pytest.fixture
def engine(demo_model_dir):
    return Engine(load_model(str(demo_model_dir), device="cpu"))


def _sync(store, engine, root, name="w1"):
    return WeightSync(store, engine, worker=name, node="n1", weights_root=root, poll_seconds=0.05)


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_without_a_target_the_start_up_weights_serve(store, engine, root):
    sync = _sync(store, engine, root)
    base = engine.weight_version
    assert not sync.may_serve  # nothing read yet: no work before the target is known
    assert sync.poll() and sync.state == "serving" and engine.weight_version == base


def test_a_new_target_loads_between_batches_and_is_reported(store, engine, root):
    sync = _sync(store, engine, root)
    sync.poll()
    store.set_target(version="step-1", model_path=str(root / "step-1"), mode="finish")
    with sync.batch() as may_serve:
        assert may_serve and engine.weight_version == "step-1"
    [record] = store.workers()
    assert (record.worker, record.node, record.state, record.version) == ("w1", "n1", "serving", "step-1")


def test_a_worker_that_starts_late_loads_the_target_before_work(store, engine, root):
    store.set_target(version="step-2", model_path=str(root / "step-2"), mode="finish")
    sync = _sync(store, engine, root)
    sync.start()
    try:
        assert engine.weight_version == "step-2" and sync.may_serve
    finally:
        sync.stop()


def test_a_failed_load_keeps_the_old_weights_and_takes_no_work(store, engine, root):
    sync = _sync(store, engine, root)
    store.set_target(version="step-1", model_path=str(root / "step-1"), mode="finish")
    sync.poll()
    before = {k: v.clone() for k, v in engine.loaded.model.state_dict().items()}
    store.set_target(version="broken", model_path=str(root / "bad"), mode="finish")
    with sync.batch(hold_seconds=0.1) as may_serve:
        assert not may_serve
    assert sync.state == "failed" and engine.weight_version == "step-1"
    after = engine.loaded.model.state_dict()
    assert all(after[k].equal(v) for k, v in before.items())
    [record] = store.workers()
    assert record.state == "failed" and record.version == "step-1" and record.error["code"] == "weights_invalid"
    assert not sync.poll()  # not retried on every poll
    store.set_target(version="step-2", model_path=str(root / "step-2"), mode="finish")
    assert sync.poll() and engine.weight_version == "step-2"


def test_a_version_is_bound_to_the_content_first_loaded_and_a_directory_overwritten_in_place_is_refused(
        store, engine, root, demo_model_dir):
    latest = root / "latest"
    shutil.copytree(root / "step-1", latest, dirs_exist_ok=True)
    first = _sync(store, engine, root)
    target = store.set_target(version="v7", model_path=str(latest), mode="finish")
    assert first.poll() and engine.weight_version == "v7"
    bound = store.target().digest
    assert bound and store.bind_digest(target.id, "another") == bound  # bound once, by the first loader
    # The trainer writes its next step over latest/; a worker that (re)starts now must not serve it as v7.
    shutil.copytree(root / "step-2", latest, dirs_exist_ok=True)
    restarted = Engine(load_model(str(demo_model_dir), device="cpu"))
    before = {k: v.clone() for k, v in restarted.loaded.model.state_dict().items()}
    late = _sync(store, restarted, root, name="w2")
    assert not late.poll() and late.state == "failed"
    error = late.record().error
    assert (error["code"], error["errors"]["problem"], error["errors"]["expected_digest"]) == (
        "weights_invalid", "content_changed", bound)
    assert all(restarted.loaded.model.state_dict()[k].equal(v) for k, v in before.items())
    # The same content under another directory (or split into other files) is the same version.
    shutil.copytree(root / "step-1", latest, dirs_exist_ok=True)
    again = _sync(store, Engine(load_model(str(demo_model_dir), device="cpu")), root, name="w3")
    assert again.poll() and again.state == "serving"


def test_a_restarted_worker_serves_a_version_from_its_nodes_copy_when_the_directory_moved_on(
        store, engine, root, demo_model_dir, tmp_path):
    kept = tmp_path / "weights-kept"
    latest = root / "latest-kept"
    shutil.copytree(root / "step-1", latest, dirs_exist_ok=True)
    first = WeightSync(store, engine, worker="w1", node="n1", weights_root=root, kept_root=kept, poll_seconds=0.05)
    store.set_target(version="v8", model_path=str(latest), mode="finish")
    assert first.poll() and engine.weight_version == "v8"
    first.keeping.join(timeout=60)
    digest = store.target().digest
    assert [p.name for p in kept.iterdir()] == [digest]
    served = {k: v.clone() for k, v in engine.loaded.model.state_dict().items()}
    for moved_on in ("overwritten", "pruned"):
        if moved_on == "overwritten":
            shutil.copytree(root / "step-2", latest, dirs_exist_ok=True)
        else:
            shutil.rmtree(latest)
        restarted = Engine(load_model(str(demo_model_dir), device="cpu"))
        late = WeightSync(store, restarted, worker="w2", node="n1", weights_root=root, kept_root=kept)
        assert late.poll() and late.state == "serving" and restarted.weight_version == "v8", moved_on
        assert all(restarted.loaded.model.state_dict()[k].equal(v) for k, v in served.items()), moved_on
    # A copy that no longer holds the version's tensors is refused like any other directory.
    shutil.copy(root / "step-2" / "model.safetensors", kept / digest / "model.safetensors")
    tampered = WeightSync(store, Engine(load_model(str(demo_model_dir), device="cpu")), worker="w3", node="n1",
                          weights_root=root, kept_root=kept)
    assert not tampered.poll() and tampered.record().error["errors"]["problem"] == "content_changed"
    # The two newest copies stay.
    build_demo_model(root / "step-3", seed=4)
    digests = []
    for version, directory in (("v9", "step-2"), ("v10", "step-3")):
        store.set_target(version=version, model_path=str(root / directory), mode="finish")
        assert first.poll()
        first.keeping.join(timeout=60)
        digests.append(store.target().digest)
    assert sorted(p.name for p in kept.iterdir()) == sorted(digests)


def test_a_target_outside_the_root_is_refused_by_the_worker_too(store, engine, root, demo_model_dir):
    sync = _sync(store, engine, root)
    store.set_target(version="evil", model_path=str(demo_model_dir), mode="finish")
    assert not sync.poll()
    assert sync.record().error["code"] == "weights_path_refused"


@pytest.mark.parametrize(("mode", "expected"), [("abort", "abort"), ("retract", "retract"), ("finish", None)])
def test_rows_in_flight_are_told_to_stop_for_abort_and_retract(store, engine, root, mode, expected):
    sync = _sync(store, engine, root)
    sync.start()
    try:
        with sync.batch() as may_serve:  # a batch in flight: the watcher must not load under it
            assert may_serve
            store.set_target(version="step-1", model_path=str(root / "step-1"), mode=mode)
            _wait(lambda: sync._target is not None)
            assert sync.interruption() == expected
            time.sleep(0.2)
            assert engine.weight_version != "step-1"  # never swapped inside a batch
        # Idle: the watcher loads it, and then nothing is told to stop any more.
        _wait(lambda: engine.weight_version == "step-1" and sync.state == "serving")
        assert sync.interruption() is None
    finally:
        sync.stop()


def test_pause_holds_batches_until_continue(store, engine, root):
    sync = _sync(store, engine, root)
    sync.start()
    try:
        store.pause("retract")
        _wait(lambda: sync.interruption() == "retract")
        with sync.batch(hold_seconds=0.1) as may_serve:
            assert not may_serve
        threading.Timer(0.3, store.resume).start()
        with sync.batch(hold_seconds=5) as may_serve:
            assert may_serve  # held, then served once generation continued
    finally:
        sync.stop()


def test_each_pause_counts_its_own_stopped_rows_and_its_call_waits_for_reports_of_it(store, engine, root):
    sync = _sync(store, engine, root)
    sync.start()
    try:
        first = store.pause("abort")
        _wait(lambda: sync.interruption() == "abort")
        sync.note_interrupted(3)  # a batch stopped three rows for the first pause
        assert [w.interrupted for w in fleet_paused(store, first, timeout=5)] == [3]
        store.resume()
        _wait(lambda: sync.interruption() is None)
        second = store.pause("abort")
        # Answered once the worker reported the second pause, with none of the first pause's rows.
        assert [(w.pause_id, w.interrupted) for w in fleet_paused(store, second, timeout=5)] == [(second.id, 0)]
        sync.note_interrupted(1)
        assert [w.interrupted for w in store.workers()] == [1]
    finally:
        sync.stop()


def test_the_update_call_answers_once_every_live_worker_serves(store, root, demo_model_dir):
    syncs = [_sync(store, Engine(load_model(str(demo_model_dir), device="cpu")), root, name=f"w{i}") for i in (1, 2)]
    for sync in syncs:
        sync.start()
    try:
        report = update_weights(store, version="step-1", model_path=str(root / "step-1"), mode="finish", timeout=30)
        assert {(w.worker, w.state, w.version) for w in report.workers} == {("w1", "serving", "step-1"),
                                                                            ("w2", "serving", "step-1")}
        assert report.to_dict()["success"] and all(s.engine.weight_version == "step-1" for s in syncs)

        with pytest.raises(WeightsRefusedError) as caught:
            update_weights(store, version="broken", model_path=str(root / "bad"), mode="finish", timeout=30)
        assert caught.value.fault is Fault.INVALID
        assert store.target().version == "step-1"  # put back: nothing changed
        _wait(lambda: all(s.may_serve for s in syncs))
        assert all(s.engine.weight_version == "step-1" for s in syncs)
    finally:
        for sync in syncs:
            sync.stop()


def test_a_refused_target_goes_back_by_the_workers_reports_even_when_the_call_stopped_waiting(store, root,
                                                                                             demo_model_dir):
    """``timeout_s: 0`` (or an API that died while waiting) left the bad target in place, and every
    worker refused it and took no work until another update: the fleet halted."""
    from domain.weights.updates import WeightsNotLoadedError

    syncs = [_sync(store, Engine(load_model(str(demo_model_dir), device="cpu")), root, name=f"w{i}") for i in (1, 2)]
    for sync in syncs:
        sync.start()
    try:
        update_weights(store, version="step-1", model_path=str(root / "step-1"), mode="finish", timeout=30)
        # The call does not wait for the refusal (or sees it, if the workers were that quick).
        with pytest.raises((WeightsNotLoadedError, WeightsRefusedError)):
            update_weights(store, version="broken", model_path=str(root / "bad"), mode="finish", timeout=0)
        _wait(lambda: store.target().version == "step-1")  # put back by the workers themselves
        _wait(lambda: all(s.may_serve for s in syncs))
        assert all(s.engine.weight_version == "step-1" for s in syncs)

        # Two refused updates in a row (the second set before the first was put back): each put-back
        # only replaces its own target, and the served one is what stays.
        first = store.set_target(version="broken-1", model_path=str(root / "bad"), mode="finish")
        second = store.set_target(version="broken-2", model_path=str(root / "bad"), mode="finish")
        assert not store.put_back(first.id)  # no longer the target: nothing to put back
        _wait(lambda: store.target().version == "step-1")
        assert store.target().id not in (first.id, second.id)
        _wait(lambda: all(s.may_serve for s in syncs))
    finally:
        for sync in syncs:
            sync.stop()


def test_a_superseded_update_call_answers_at_once_with_a_409(store, root):
    """It waited its full timeout although the fleet had moved on to a newer target."""
    from domain.weights.store import WorkerWeights
    from domain.weights.updates import WeightsSupersededError

    # A worker still loading (played by the test, as its record says while a large checkpoint loads).
    store.report(WorkerWeights(worker="w1", node="n1", state="loading", version="base", target_id=None))
    threading.Timer(0.3, lambda: store.set_target(version="step-2", model_path=str(root / "step-2"),
                                                  mode="finish")).start()
    started = time.monotonic()
    with pytest.raises(WeightsSupersededError) as caught:
        update_weights(store, version="step-1", model_path=str(root / "step-1"), mode="finish", timeout=30)
    assert caught.value.fault is Fault.CONFLICT and time.monotonic() - started < 5
    assert caught.value.errors["target"]["version"] == "step-2"
