"""The API against a real embedded Redis with a small maxmemory: new work is refused with 503
``redis_memory_full`` from the high-water mark, while a worker still ends the jobs it accepted;
/healthz and /metrics show Redis' memory; past the bound, a write Redis refuses answers the same
code. An unbounded Redis refuses nothing."""

from __future__ import annotations

import re

import pytest
import redis

from domain.infra.redis_memory import default_maxmemory_bytes
from domain.infra.redis_server import EmbeddedRedis
from domain.lifecycle import end_job
from domain.settings import Settings
from launcher.stack import embedded_maxmemory
from tests.domain.infra.test_redis_memory import MIB, fill_until
from tests.web.api.test_stream_memory import large_result
from tests.web.conftest import KEY_A, KEY_B, auth
from web.app import create_app

BOUND = 8 * MIB
JOB = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}


@pytest.fixture
def bounded(tmp_path, demo_model_dir):
    server = EmbeddedRedis(tmp_path / "redis", persistent=False, maxmemory=BOUND).start()
    app = create_app(Settings(state_dir=tmp_path, model=str(demo_model_dir), api_keys=(KEY_A, KEY_B)), server.url)
    app.config["TESTING"] = True
    client = redis.Redis.from_url(server.url)
    yield app, client
    client.close()
    server.stop()


def gauges(api) -> dict[str, float]:
    text = api.get("/metrics").get_data(as_text=True)
    return {name: float(value) for name, value in
            re.findall(r"^(rollout_redis_(?:used_memory|maxmemory)_bytes) (\S+)$", text, re.M)}


def test_new_work_is_refused_at_the_high_water_mark_and_accepted_work_ends(bounded):
    app, client = bounded
    api, svc = app.test_client(), app.extensions["rollout"]
    accepted = api.post("/v1/jobs", json=JOB, headers=auth())
    assert accepted.status_code == 202
    health = api.get("/healthz").get_json()["redis_memory"]
    assert health["state"] == "ok" and health["maxmemory_bytes"] == BOUND
    assert health["high_water_bytes"] == int(0.9 * BOUND) > health["used_bytes"] > 0
    assert gauges(api)["rollout_redis_maxmemory_bytes"] == BOUND

    fill_until(client, int(0.93 * BOUND))
    svc.redis_memory.read(fresh=True)  # not the second-old reading: the test need not wait it out
    for path, body in (("/v1/jobs", JOB), ("/v1/jobs/bulk", {"jobs": [JOB, JOB]}), ("/v1/generate", JOB)):
        refused = api.post(path, json=body, headers=auth())
        assert refused.status_code == 503, (path, refused.get_json())
        assert refused.get_json()["code"] == "redis_memory_full" and refused.headers["Retry-After"] == "60"
    refused = api.post("/v1/batches", data=b'{"custom_id": "r0", "body": {"token_ids": [1]}}\n',
                       content_type="application/jsonl", headers=auth())
    assert (refused.status_code, refused.get_json()["code"]) == (503, "redis_memory_full")
    health = api.get("/healthz")
    assert health.status_code == 503 and health.get_json()["status"] == "degraded"
    assert health.get_json()["redis_memory"]["state"] == "refusing_new_work"
    numbers = gauges(api)
    assert numbers["rollout_redis_used_memory_bytes"] >= 0.9 * numbers["rollout_redis_maxmemory_bytes"] == 0.9 * BOUND

    # The GPU worker's end of the accepted job (a result as it stores one) fits in the room left.
    job_id = accepted.get_json()["id"]
    assert end_job(svc, job_id, "succeeded", result=large_result(512))
    assert api.get(f"/v1/jobs/{job_id}", headers=auth()).get_json()["status"] == "succeeded"

    client.delete(*client.keys("filler:*"))  # results expire: new work is taken again
    svc.redis_memory.read(fresh=True)
    assert api.post("/v1/jobs", json=JOB, headers=auth()).status_code == 202


def test_a_write_redis_refuses_past_its_bound_answers_the_same_code(bounded):
    app, client = bounded
    api = app.test_client()
    job_id = api.post("/v1/jobs", json=JOB, headers=auth()).get_json()["id"]
    fill_until(client, BOUND)  # past it: Redis refuses every write (noeviction)
    cancelled = api.delete(f"/v1/jobs/{job_id}", headers=auth())  # a write no admission check guards
    assert (cancelled.status_code, cancelled.get_json()["code"]) == (503, "redis_memory_full")
    assert api.get(f"/v1/jobs/{job_id}", headers=auth()).status_code == 200  # reads still answer


def test_an_unbounded_redis_refuses_nothing(make_app):
    api = make_app().test_client()  # the session's Redis: no maxmemory
    assert api.post("/v1/jobs", json=JOB, headers=auth()).status_code == 202
    assert api.get("/healthz").get_json()["redis_memory"]["state"] == "unbounded"
    assert gauges(api)["rollout_redis_maxmemory_bytes"] == 0


def test_up_bounds_its_embedded_redis_by_the_setting_or_the_machine():
    assert embedded_maxmemory(Settings()) == default_maxmemory_bytes()
    assert embedded_maxmemory(Settings(redis_maxmemory_bytes=64 * MIB)) == 64 * MIB
    assert embedded_maxmemory(Settings(redis_maxmemory_bytes=0)) == 0  # asked for: no bound
