"""Where a worker finds its runtime (workers/runtime.py): on its Celery app, one per process."""

from __future__ import annotations

import os

import pytest

from domain.settings import Settings
from tests.conftest import db_url
from workers.celery_app import create_celery
from workers.runtime import fresh_runtime, runtime


def test_the_app_keeps_one_runtime_until_a_pool_process_asks_for_a_fresh_one(redis_url, tmp_path):
    app = create_celery(Settings(state_dir=tmp_path), db_url(redis_url, 28))
    first = runtime(app)
    assert runtime(app) is first and first.celery is app
    replaced = fresh_runtime(app)
    assert replaced is not first and runtime(app) is replaced


def test_a_forked_child_given_a_fresh_runtime_talks_to_redis_on_its_own_connection(redis_url, tmp_path):
    app = create_celery(Settings(state_dir=tmp_path), db_url(redis_url, 28))
    parent = runtime(app)
    parent.redis.set("runtime-test", "parent")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # what Celery's prefork pool does, then worker_process_init
        child = fresh_runtime(app)
        ok = child is not parent and child.redis.get("runtime-test") == b"parent"
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert parent.redis.get("runtime-test") == b"parent"  # the parent's connection still works


@pytest.mark.gpu
def test_on_cuda_the_kv_pool_takes_its_share_of_free_device_memory(demo_model_dir):
    import torch

    from domain.limits import build_limits
    from engine.loading import load_model
    from engine.paged_kv import kv_bytes_per_token
    from workers.runtimes import _pool_sized

    loaded = load_model(str(demo_model_dir), device="cuda")
    settings = Settings(kv_cache_memory_fraction=0.5, kv_cache_tokens=2**40)
    free, _ = torch.cuda.mem_get_info(loaded.device)
    tokens = _pool_sized(build_limits(settings, None).scheduler, settings, loaded).kv_cache_tokens
    assert abs(tokens * kv_bytes_per_token(loaded.model.config, loaded.dtype) - free / 2) < free * 0.01
    capped = Settings(kv_cache_memory_fraction=0.5, kv_cache_tokens=4096)
    assert _pool_sized(build_limits(capped, None).scheduler, capped, loaded).kv_cache_tokens == 4096
