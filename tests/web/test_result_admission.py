"""Admission by what a job will write (#56 items 1 and 2): a job whose result could pass
``ROLLOUT_MAX_RESULT_BYTES`` is a 422 ``result_too_large`` on every route that makes jobs; on a
Redis with a bound, each accepted job's result bound is reserved against the room below the
high-water mark (real embedded Redis, small maxmemory), new work refused with 503
``redis_memory_full`` when it does not fit, and the job's end gives its reservation back."""

from __future__ import annotations

import json

import pytest
import redis

from domain.infra import redis_reservations
from domain.infra.redis_server import EmbeddedRedis
from domain.infra.store_errors import StoreFull
from domain.lifecycle import end_job
from domain.settings import Settings
from engine.result_bound import request_result_bound
from tests.web.conftest import KEY_A, KEY_B, auth
from web.app import create_app
from workers.tasks.batches import submit_chunk

MIB = 1024 * 1024
BOUND = 8 * MIB  # new work stops at 7.2 MiB
# About 0.9 MB of result at the most: its 4,000 tokens with 5 top logprobs each.
BIG = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4000, "top_logprobs": 5}}
SMALL = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}


@pytest.mark.parametrize(("path", "body", "where"), [
    ("/v1/jobs", BIG, None),
    ("/v1/jobs/bulk", {"jobs": [SMALL, BIG]}, "jobs.1"),
    ("/v1/generate", BIG, None),
    ("/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4000, "logprobs": 5}}, None),
    ("/generate", {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_new_tokens": 4000},
                   "return_logprob": True, "top_logprobs_num": 5}, None),
])
def test_a_job_past_the_result_limit_is_refused_on_every_route(make_app, path, body, where):
    api = make_app(max_result_bytes=256 * 1024).test_client()
    refused = api.post(path, json=body, headers=auth())
    error = refused.get_json()
    error = error["error"] if isinstance(error.get("error"), dict) else error  # a dialect's OpenAI shape
    assert (refused.status_code, error["code"]) == (422, "result_too_large"), error
    assert "ROLLOUT_MAX_RESULT_BYTES (262144)" in error["message"]
    if "errors" in error:  # the native shape: the figures by name
        figures = error["errors"][where] if where else error["errors"]
        assert figures["max_result_bytes"] == 256 * 1024 < figures["result_bytes"]
    assert api.get("/v1/jobs", headers=auth()).get_json()["data"] == []  # nothing was made
    assert api.post("/v1/jobs", json=SMALL, headers=auth()).status_code == 202


def test_a_batch_line_past_the_result_limit_is_refused_at_upload(make_app):
    api = make_app(max_result_bytes=256 * 1024).test_client()
    line = b'{"custom_id": "r0", "body": {"token_ids": [1], "sampling_params": {"max_tokens": 4000, "top_logprobs": 5}}}\n'
    refused = api.post("/v1/batches", data=line, content_type="application/jsonl", headers=auth())
    assert refused.status_code == 422 and "result_too_large" in refused.get_data(as_text=True)


@pytest.fixture
def bounded(tmp_path, demo_model_dir):
    server = EmbeddedRedis(tmp_path / "redis", persistent=False, maxmemory=BOUND).start()
    app = create_app(Settings(state_dir=tmp_path, model=str(demo_model_dir), api_keys=(KEY_A, KEY_B)), server.url)
    app.config["TESTING"] = True
    client = redis.Redis.from_url(server.url)
    yield app, client
    client.close()
    server.stop()


def reserved(client: redis.Redis) -> int:
    return int(client.get(redis_reservations.TOTAL_KEY) or 0)


def test_accepted_jobs_reserve_their_results_and_new_work_past_the_mark_is_refused(bounded):
    app, client = bounded
    api, svc = app.test_client(), app.extensions["rollout"]
    each = request_result_bound({**BIG, "sampling_params": {**BIG["sampling_params"], "n": 1}},
                                context_tokens=svc.limits.context_tokens, vocab_size=svc.model_facts.vocab_size)
    accepted = []
    while (reply := api.post("/v1/jobs", json=BIG, headers=auth())).status_code == 202:
        accepted.append(reply.get_json()["id"])
        assert len(accepted) < 20
    # Used memory alone would take more: what the accepted jobs may still write fills the room.
    used = int(client.info("memory")["used_memory"])
    assert used + reserved(client) <= 0.9 * BOUND < used + reserved(client) + each
    assert 3 <= len(accepted) and reserved(client) == len(accepted) * each
    error = reply.get_json()
    assert (reply.status_code, error["code"], reply.headers["Retry-After"]) == (503, "redis_memory_full", "60")
    assert error["errors"]["asked_bytes"] == each and error["errors"]["reserved_bytes"] == reserved(client)
    assert api.post("/v1/jobs", json=SMALL, headers=auth()).status_code == 202  # a small one still fits
    svc.redis_memory.read(fresh=True)
    assert api.get("/healthz").get_json()["redis_memory"]["reserved_bytes"] == reserved(client)

    # A bulk that does not fit whole is refused whole: none of its jobs is made or reserved.
    before = (reserved(client), svc.jobs.active_count(KEY_A))
    bulk = api.post("/v1/jobs/bulk", json={"jobs": [SMALL, BIG, BIG]}, headers=auth())
    assert (bulk.status_code, bulk.get_json()["code"]) == (503, "redis_memory_full")
    assert (reserved(client), svc.jobs.active_count(KEY_A)) == before

    # An accepted job's end (its result written) gives its reservation back: the next one fits.
    assert end_job(svc, accepted[0], "succeeded", result={"choices": [], "usage": {}})
    assert end_job(svc, accepted[1], "cancelled")
    assert reserved(client) == before[0] - 2 * each
    assert api.post("/v1/jobs", json=BIG, headers=auth()).status_code == 202


def test_a_job_the_queue_caps_refuse_reserves_nothing(tmp_path, demo_model_dir):
    server = EmbeddedRedis(tmp_path / "redis", persistent=False, maxmemory=BOUND).start()
    try:
        settings = Settings(state_dir=tmp_path, model=str(demo_model_dir), api_keys=(KEY_A,), max_queued_per_key=2)
        app = create_app(settings, server.url)
        api, client = app.test_client(), redis.Redis.from_url(server.url)
        bulk = api.post("/v1/jobs/bulk", json={"jobs": [SMALL, SMALL, SMALL]}, headers=auth()).get_json()
        assert [job is None for job in bulk["data"]] == [False, False, True]
        assert client.hlen(redis_reservations.BYTES_KEY) == 2
        assert api.post("/v1/jobs", json=SMALL, headers=auth()).status_code == 429
        assert client.hlen(redis_reservations.BYTES_KEY) == 2
    finally:
        server.stop()


def test_an_unbounded_redis_reserves_nothing(make_app, redis_client):
    api = make_app().test_client()
    assert api.post("/v1/jobs", json=BIG, headers=auth()).status_code == 202
    assert reserved(redis_client) == 0


def test_a_batch_chunk_reserves_its_jobs_results_or_waits(bounded):
    app, client = bounded
    api, svc = app.test_client(), app.extensions["rollout"]  # the API's services carry what a worker runtime does

    def batch_of(lines: int) -> str:
        body = b"".join(b'{"custom_id": "r%d", "body": %s}\n' % (n, json.dumps(BIG).encode()) for n in range(lines))
        reply = api.post("/v1/batches", data=body, content_type="application/jsonl", headers=auth())
        assert reply.status_code in (200, 201, 202), reply.get_json()
        return reply.get_json()["id"]

    too_many = batch_of(12)  # about 11 MB of results at the most: past the 7.2 MiB mark
    with pytest.raises(StoreFull):
        submit_chunk(svc, too_many, 0)
    assert reserved(client) == 0 and svc.jobs.active_count(KEY_A) == 0  # none made, none reserved
    assert submit_chunk(svc, batch_of(3), 0) == 3
    assert client.hlen(redis_reservations.BYTES_KEY) == 3 and reserved(client) > 0
