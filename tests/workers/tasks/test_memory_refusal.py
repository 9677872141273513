"""A task whose write Redis refuses for memory puts its message back and fails nothing
(workers/tasks/outage.py, workers/memory_refusal.py): the preprocess task on a Redis at its
maxmemory, run in this process against a real embedded Redis with a small bound."""

from __future__ import annotations

import pytest
import redis
from celery.exceptions import Reject

from domain.infra.redis_server import EmbeddedRedis
from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_job
from domain.names import PREPROCESS_TASK
from domain.settings import Settings
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.memory_refusal import refused_for_memory
from workers.runtime import runtime

BOUND = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-bound"), persistent=False, maxmemory=BOUND).start()
    yield server
    server.stop()


@pytest.fixture
def client(server):
    client = redis.Redis.from_url(server.url)
    yield client
    client.delete(*client.keys("fill:*") or ["fill:none"])
    client.close()


def fill(client: redis.Redis) -> None:
    index = 0
    for size in (10_000, 500, 20):
        try:
            while True:
                client.set(f"fill:{index}", "x" * size)
                index += 1
        except redis.exceptions.OutOfMemoryError:
            pass


def test_a_refusal_is_told_by_its_type_and_a_scripts_by_redis_memory(client):
    fill(client)
    with pytest.raises(redis.exceptions.OutOfMemoryError) as typed:
        client.lpush("probe", "x")
    with pytest.raises(redis.ResponseError) as scripted:
        client.eval("redis.call('SET', KEYS[1], 'v') return 1", 1, "probe")
    assert type(scripted.value) is redis.ResponseError  # Redis 6 wraps a script's OOM reply
    assert refused_for_memory(None, typed.value) and refused_for_memory(client, scripted.value)
    assert not refused_for_memory(None, scripted.value)  # nowhere to read memory: not told
    with pytest.raises(redis.ResponseError) as other:
        client.eval("return redis.error_reply('ERR not a refusal')", 0)
    client.delete(*client.keys("fill:*"))
    assert not refused_for_memory(client, other.value)  # a script's own error, Redis has room


def test_the_preprocess_task_requeues_its_message_and_leaves_the_job_queued(server, client, tmp_path):
    app = create_celery(Settings(state_dir=tmp_path), server.url)
    app.loader.import_default_modules()
    rt = runtime(app)
    request = JobRequest.from_dict(stored_request(prompt="hello", sampling_params={"max_tokens": 1}))
    job_id = submit_job(rt.jobs, rt.celery, owner="key_owner", request=request)["id"]
    fill(client)
    with pytest.raises(Reject) as rejected:
        app.tasks[PREPROCESS_TASK](job_id)
    assert rejected.value.requeue is True
    assert rt.jobs.get(job_id)["status"] == "queued"
