"""A GPU worker's adapter sync against the fleet's load and unload calls (#58 items 1, 5): real
Redis, the demo model's engine, the sync's own thread. A load answers once the worker serves it;
an adapter every worker refuses is put back and the old version keeps serving; an unload retires
it; a worker that starts loads the current set."""

from __future__ import annotations

import shutil

import pytest
import redis
import torch
from safetensors.torch import load_file, save_file

from domain.adapters import fleet
from domain.adapters.store import AdapterRegistry
from domain.infra.redis_server import EmbeddedRedis
from engine.generation import Engine
from engine.loading import load_model
from engine.lora.errors import AdapterInvalidError, AdapterLimitError, AdapterNotFoundError
from tests.engine.lora.lora_support import make_adapter
from workers.gpu.adapter_sync import AdapterSync, engine_adapter


@pytest.fixture(scope="module")
def root(tmp_path_factory, demo_model_dir):
    root = tmp_path_factory.mktemp("sync-root")
    make_adapter(demo_model_dir, root / "good", rank=2, alpha=4, seed=1, suffixes=("q_proj",))
    shutil.copytree(root / "good", root / "bad")
    tensors = load_file(root / "bad" / "adapter_model.safetensors")
    tensors = {name: torch.full_like(t, float("inf")) for name, t in tensors.items()}
    save_file(tensors, root / "bad" / "adapter_model.safetensors")
    return root


@pytest.fixture(scope="module")
def fleet_redis(tmp_path_factory):
    """A Redis of this module's own: a GPU runtime another test left in this process (its adapter
    sync still reporting, as a live worker would) must not count as a worker of this fleet."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("fleet-redis"), persistent=False).start()
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()
    server.stop()


@pytest.fixture
def registry(fleet_redis):
    fleet_redis.flushdb()
    return AdapterRegistry(fleet_redis)


@pytest.fixture
def worker(registry, demo_model_dir, root):
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    sync = AdapterSync(registry, engine, worker="gpu-test", weights_root=root, poll_seconds=0.02)
    sync.start()
    yield sync
    sync.stop()


def _load(registry, root, name, path, inplace=False, cap=None):
    return fleet.load(registry, scope="k", name=name, path=str(root / path), inplace=inplace, per_key_cap=cap,
                      timeout=10)


def test_load_refuse_update_and_unload_across_the_fleet(worker, registry, root):
    entry = _load(registry, root, "x", "good")
    assert worker.engine.adapter_ids == [entry.id]
    with pytest.raises(AdapterInvalidError) as raised:
        _load(registry, root, "x", "bad", inplace=True)
    assert raised.value.errors["problem"] == "non_finite"
    assert registry.get("k", "x") == entry, "put back"
    assert entry.id in worker.engine.adapter_ids, "the old version kept serving"
    with pytest.raises(fleet.AdapterExistsError):
        _load(registry, root, "x", "good")
    newer = _load(registry, root, "x", "good", inplace=True)
    assert worker.engine.adapter_ids == [newer.id], "the new version serves, the old retired"
    with pytest.raises(AdapterLimitError):
        _load(registry, root, "y", "good", cap=1)
    fleet.unload(registry, scope="k", name="x", timeout=10)
    assert worker.engine.adapter_ids == []
    with pytest.raises(AdapterNotFoundError):
        fleet.unload(registry, scope="k", name="x", timeout=10)


def test_a_worker_that_starts_loads_the_current_set(registry, root, demo_model_dir):
    entry, _, _ = registry.put(scope="k", name="early", path=str(root / "good"))  # no worker yet
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    sync = AdapterSync(registry, engine, worker="gpu-late", weights_root=root)
    sync.start()
    try:
        assert engine.adapter_ids == [entry.id]
        [report] = [w for w in registry.workers() if w.worker == "gpu-late"]
        assert report.epoch == registry.epoch() and report.ids == [entry.id]
    finally:
        sync.stop()


TOKENS = 64


def update_while_decoding(worker, registry, root, mode: str):
    """A row of adapter x and a base row decode; three steps in, x is replaced in place in ``mode``
    through the fleet call (answered once the worker's sync applied it). Each row's choice, and
    the old and new entries."""
    from engine.generation import GenerationRequest
    from engine.sampling_params import SamplingParams

    old = _load(registry, root, "x", "good")
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    prompt = [300, 301, 302, 303, 304]
    scheduler = worker.engine.scheduler()
    finished = []
    try:
        old_row = scheduler.submit(GenerationRequest(prompt, params, adapter=old.id))
        base_row = scheduler.submit(GenerationRequest(prompt, params))
        for _ in range(3):
            finished += scheduler.step()
        new = fleet.load(registry, scope="k", name="x", path=str(root / "good"), inplace=True, per_key_cap=None,
                         timeout=10, mode=mode)
        assert worker.engine.adapter_ids == [new.id]
        while scheduler.has_work:
            finished += scheduler.step()
    finally:
        scheduler.close()
    by_handle = {done.handle: done.result.choices[0] for done in finished}
    return by_handle[old_row], by_handle[base_row], old, new


def test_an_update_in_mode_abort_ends_the_old_versions_rows_only(worker, registry, root):
    aborted, base, _, _ = update_while_decoding(worker, registry, root, "abort")
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < TOKENS
    assert base.finish_reason == "length" and len(base.token_ids) == TOKENS


def test_an_update_in_mode_keep_carries_the_old_versions_rows_over(worker, registry, root):
    kept, base, old, new = update_while_decoding(worker, registry, root, "keep")
    assert kept.finish_reason == "length" and len(kept.token_ids) == TOKENS
    assert [span["adapter"] for span in kept.weight_versions] == [old.id, new.id]
    assert kept.weight_versions[0]["end"] == kept.weight_versions[1]["start"] >= 3
    assert base.weight_versions == [{"version": worker.engine.weight_version, "start": 0, "end": TOKENS}]


def test_a_job_queued_under_a_replaced_version_runs_under_the_served_one():
    """The id the API resolved was replaced in place while the job waited: it runs under that
    adapter's version served now; an unloaded adapter, or a name nobody resolved, stays refused."""
    served = ["k/x@7", "k/y@3"]
    assert engine_adapter("k/x@5", served) == "k/x@7"
    assert engine_adapter("k/x@7", served) == "k/x@7"
    assert engine_adapter("k/z@2", served) == "k/z@2"  # unloaded: refused
    assert engine_adapter("x", served) == "x"  # a batch line's name nobody resolved: refused
    assert engine_adapter("", served) == ""
