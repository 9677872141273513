"""The job API against a real Redis, without workers (so jobs stay where the API left them)."""

from __future__ import annotations

import pytest

from tests.web.conftest import KEY_A, KEY_B, auth

PROMPT = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "temperature": 0}}


def submit(client, body=None, key=None):
    return client.post("/v1/jobs", json=PROMPT if body is None else body, headers=auth(key) if key else auth())


def test_submit_returns_202_with_job_and_link(client):
    response = submit(client)
    assert response.status_code == 202
    job = response.get_json()
    assert job["status"] == "queued" and job["kind"] == "generate"
    assert response.headers["Location"] == f"/v1/jobs/{job['id']}" == job["links"]["self"]
    assert len(job["id"]) > 20
    polled = client.get(job["links"]["self"], headers=auth()).get_json()
    assert polled["id"] == job["id"] and polled["status"] == "queued"


def test_other_key_sees_404_exactly_like_unknown_id(client):
    job = submit(client).get_json()
    stranger = client.get(f"/v1/jobs/{job['id']}", headers=auth(KEY_B))
    unknown = client.get("/v1/jobs/job_doesnotexist", headers=auth(KEY_B))
    assert stranger.status_code == unknown.status_code == 404
    assert stranger.get_json()["code"] == unknown.get_json()["code"] == "not_found"
    assert client.delete(f"/v1/jobs/{job['id']}", headers=auth(KEY_B)).status_code == 404


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}])
def test_missing_or_wrong_key_is_401(client, headers):
    response = client.post("/v1/jobs", json=PROMPT, headers=headers)
    assert response.status_code == 401
    assert response.get_json()["code"] == "unauthorized"


def test_unknown_fields_are_named_in_a_422(client):
    response = submit(client, {**PROMPT, "tokens": [1], "sampling_params": {"max_tokens": 2, "beam": 3}})
    assert response.status_code == 422
    body = response.get_json()
    assert body["code"] == "invalid_request"
    assert "tokens" in body["errors"] and "beam" in body["errors"]["sampling_params"]


def test_content_parts_and_features_together_is_422_naming_both(client):
    body = {**PROMPT, "content_parts": [{"type": "image_url", "url": "https://example.com/a.png"}],
            "features": [{"modality": "image", "tensors": {"x": {"dtype": "float32", "shape": [1], "data": "AAAAAA=="}}}]}
    response = submit(client, body)
    assert response.status_code == 422
    message = str(response.get_json())
    assert "content_parts" in message and "features" in message


@pytest.mark.parametrize("body", [
    {"token_ids": []},
    {"token_ids": [-1]},
    {"token_ids": [1.5]},
    {"token_ids": ["1"]},
    {"prompt": "hi", "token_ids": [1]},
    {},
    {"prompt": "hi", "sampling_params": {"temperature": -1}},
    {"prompt": "hi", "sampling_params": {"max_tokens": 2.5e-42}},
    {"prompt": "hi", "sampling_params": {"max_tokens": 2, "max_new_tokens": 2}},
    {"prompt": "hi", "kind": "score"},
    {"prompt": "hi", "completion_token_ids": [1]},
    {"prompt": "hi", "metadata": {"x": "y" * 5000}},
    {"prompt": "hi", "webhook": {"url": "ftp://example.com/hook"}},
    {"prompt": "hi", "content_parts": [{"type": "pdf_url", "url": "https://example.com/a.pdf"}]},
])
def test_bad_requests_are_422_with_a_code(client, body):
    response = submit(client, body)
    assert response.status_code == 422, response.get_json()
    assert response.get_json()["code"] in {"invalid_request"}


def test_non_json_body_is_a_4xx(client):
    response = client.post("/v1/jobs", data="not json", headers={**auth(), "Content-Type": "application/json"})
    assert 400 <= response.status_code < 500
    assert "code" in response.get_json()


def test_native_requests_take_only_our_names(client):
    """SGLang's names belong to SGLang's /generate (web/dialects); the native shape has one name each."""
    body = {"input_ids": [5, 6], "sampling_params": {"max_tokens": 3}, "return_logprob": True, "rid": "r1",
            "image_data": "data:image/png;base64,AAAA"}
    response = client.post("/v1/jobs", json=body, headers=auth())
    assert response.status_code == 422
    assert {"input_ids", "return_logprob", "rid", "image_data"} <= set(response.get_json()["errors"])


def test_default_max_tokens_comes_from_settings(make_app):
    client = make_app(default_max_tokens=7).test_client()
    job_id = submit(client, {"prompt": "hello"}).get_json()["id"]
    stored = client.application.extensions["rollout"].jobs.get(job_id)["request"]
    assert stored["sampling_params"]["max_tokens"] == 7


def test_too_many_content_parts(make_app):
    client = make_app(max_content_parts=1).test_client()
    parts = [{"type": "image_url", "url": "https://example.com/a.png"}] * 2
    response = submit(client, {"prompt": "x", "content_parts": parts})
    assert response.status_code == 422 and response.get_json()["code"] == "too_many_content_parts"


def test_context_length_is_checked_on_submit(make_app):
    client = make_app(max_model_len=10).test_client()
    response = submit(client, {"token_ids": [1] * 8, "sampling_params": {"max_tokens": 5}})
    assert response.status_code == 422 and response.get_json()["code"] == "context_length_exceeded"


def test_a_request_that_can_never_fit_the_gpu_batch_is_refused_on_submit(make_app):
    # A pool of 10 blocks of 16 tokens; a row of 10 + 40 tokens takes 4 of them.
    client = make_app(kv_cache_tokens=160, kv_block_tokens=16, gpu_batch_size=4).test_client()
    fits = submit(client, {"token_ids": [100] * 10, "sampling_params": {"max_tokens": 40, "n": 2}})
    assert fits.status_code == 202
    for params in ({"max_tokens": 40, "n": 3}, {"max_tokens": 155}, {"max_tokens": 1, "n": 5}):
        response = submit(client, {"token_ids": [100] * 10, "sampling_params": params})
        assert response.status_code == 422, params
        assert response.get_json()["code"] == "request_exceeds_capacity"


def test_body_size_limit_is_413(make_app):
    client = make_app(max_body_bytes=2048).test_client()
    response = submit(client, {"prompt": "x" * 4096})
    assert response.status_code == 413 and response.get_json()["code"] == "payload_too_large"


def test_queue_cap_per_key_is_429_with_retry_after(make_app):
    client = make_app(max_queued_per_key=2).test_client()
    assert submit(client).status_code == 202 and submit(client).status_code == 202
    response = submit(client)
    assert response.status_code == 429 and response.get_json()["code"] == "queue_full"
    assert int(response.headers["Retry-After"]) > 0
    assert submit(client, key=KEY_B).status_code == 202  # another key is not affected


def test_cancel_queued_job_is_immediate_and_idempotent(client):
    job = submit(client).get_json()
    first = client.delete(f"/v1/jobs/{job['id']}", headers=auth())
    second = client.delete(f"/v1/jobs/{job['id']}", headers=auth())
    assert first.status_code == second.status_code == 200
    assert first.get_json()["status"] == second.get_json()["status"] == "cancelled"


def test_list_own_jobs_newest_first_with_pagination(client):
    ids = [submit(client).get_json()["id"] for _ in range(5)]
    submit(client, key=KEY_B)
    page = client.get("/v1/jobs?limit=3", headers=auth()).get_json()
    assert [j["id"] for j in page["data"]] == ids[::-1][:3]
    rest = client.get(f"/v1/jobs?limit=3&cursor={page['next_cursor']}", headers=auth()).get_json()
    assert [j["id"] for j in rest["data"]] == ids[::-1][3:]
    client.delete(f"/v1/jobs/{ids[0]}", headers=auth())
    cancelled = client.get("/v1/jobs?status=cancelled", headers=auth()).get_json()
    assert [j["id"] for j in cancelled["data"]] == [ids[0]]
    assert client.get("/v1/jobs?bogus=1", headers=auth()).status_code == 422
    # A listed job is the job without its result (up to tens of MB): GET /v1/jobs/{id} serves that.
    client.application.extensions["rollout"].jobs.advance(ids[1], "succeeded", result={"choices": []})
    [listed] = client.get("/v1/jobs?status=succeeded", headers=auth()).get_json()["data"]
    whole = client.get(f"/v1/jobs/{ids[1]}", headers=auth()).get_json()
    assert whole["result"] == {"choices": []} and listed == {k: v for k, v in whole.items() if k != "result"}


def test_unknown_route_and_method_use_the_error_shape(client):
    missing = client.get("/v1/nothing", headers=auth())
    assert missing.status_code == 404 and missing.get_json()["code"] == "not_found"
    wrong = client.put("/v1/jobs", headers=auth())
    assert wrong.status_code == 405 and wrong.get_json()["code"] == "method_not_allowed"


def test_openapi_lists_statuses(client):
    spec = client.get("/openapi.json").get_json()
    post = spec["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"202", "401", "413", "422", "429", "503"} <= set(post)


def test_vllm_abort_requests_cancels_the_callers_jobs_by_request_id_or_all_when_told(client):
    def job(rid, key=KEY_A):
        body = {"token_ids": [1, 2], "request_id": rid, "sampling_params": {"max_tokens": 2}}
        return client.post("/v1/jobs", json=body, headers=auth(key)).get_json()["id"]

    mine = {rid: job(rid) for rid in ("a", "b", "c")}
    theirs = job("a", key=KEY_B)
    reply = client.post("/abort_requests", json={"request_ids": ["a", "b", "nothing-by-that-id"]}, headers=auth())
    assert reply.status_code == 200 and reply.get_json() == {"status": "aborted", "aborted": 2}

    def status(job_id, key=KEY_A):
        return client.get(f"/v1/jobs/{job_id}", headers=auth(key)).get_json()["status"]

    assert [status(mine[rid]) for rid in "abc"] == ["cancelled", "cancelled", "queued"]
    assert status(theirs, KEY_B) == "queued"  # another key's job with the same request id is not ours to abort
    # Nothing but an explicit abort_all aborts all: a misspelled field, null or an empty body is a 422,
    # an empty list aborts nothing.
    for body in ({}, {"request_id": ["c"]}, {"request_ids": None}, {"rids": ["c"], "abort_all": False},
                 {"request_ids": ["c"], "abort_all": True}):
        reply = client.post("/abort_requests", json=body, headers=auth())
        assert reply.status_code == 422, (body, reply.get_json())
    assert client.post("/abort_requests", json={"request_ids": []}, headers=auth()).get_json()["aborted"] == 0
    assert status(mine["c"]) == "queued"
    reply = client.post("/abort_requests", json={"abort_all": True}, headers=auth())
    assert reply.get_json() == {"status": "aborted", "aborted": 1}
    assert status(mine["c"]) == "cancelled" and status(theirs, KEY_B) == "queued"


def test_one_context_limit_for_the_api_the_cpu_worker_and_the_engine(make_app, redis_url, demo_model_dir, tmp_path):
    """ROLLOUT_MAX_MODEL_LEN is the limit every layer checks, built once (domain/limits.py): the
    API's, the CPU worker's after expansion (which fell back to 32,768 where the others had none)
    and the engine's (which used the model's own)."""
    from domain.settings import Settings
    from workers.runtimes import GpuRuntime

    app = make_app(max_model_len=100)
    assert app.extensions["rollout"].limits.context_tokens == 100
    too_long = app.test_client().post("/v1/jobs", json={"token_ids": [100] * 90, "sampling_params": {"max_tokens": 11}},
                                      headers=auth())
    assert too_long.status_code == 422 and too_long.get_json()["code"] == "context_length_exceeded"
    rt = GpuRuntime(Settings(model=str(demo_model_dir), state_dir=tmp_path, max_model_len=100), redis_url)
    assert rt.limits.context_tokens == 100
    assert rt.engine.loaded.context_tokens == 100
    # Never past the model's own context.
    huge = GpuRuntime(Settings(model=str(demo_model_dir), state_dir=tmp_path, max_model_len=10**7), redis_url)
    assert huge.engine.loaded.context_tokens == huge.model_facts.context_tokens < 10**7


def test_a_long_poll_answers_when_the_job_ends_and_wakes_every_waiter(make_app):
    import threading
    import time

    app = make_app()
    job = submit(app.test_client()).get_json()
    answers: dict[int, tuple[float, str]] = {}

    def poll(index: int) -> None:
        started = time.monotonic()
        body = app.test_client().get(f"/v1/jobs/{job['id']}?wait=20", headers=auth()).get_json()
        answers[index] = (time.monotonic() - started, body["status"])

    waiters = [threading.Thread(target=poll, args=(i,)) for i in range(3)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.5)
    services = app.extensions["rollout"]
    assert services.jobs.advance(job["id"], "succeeded", result={"choices": []})  # a worker ends it
    for waiter in waiters:
        waiter.join(timeout=30)
    assert sorted(status for _, status in answers.values()) == ["succeeded"] * 3
    assert all(0.4 < seconds < 10 for seconds, _ in answers.values()), answers


def test_a_long_poll_of_a_running_job_answers_after_its_wait(client):
    import time

    job = submit(client).get_json()
    started = time.monotonic()
    polled = client.get(f"/v1/jobs/{job['id']}?wait=0.3", headers=auth())
    assert polled.status_code == 200 and polled.get_json()["status"] == "queued"
    assert 0.25 < time.monotonic() - started < 5


@pytest.mark.parametrize("query", ["wait=-1", "wait=soon", "cache_buster=1"])
def test_a_bad_poll_query_is_a_422(client, query):
    job = submit(client).get_json()
    response = client.get(f"/v1/jobs/{job['id']}?{query}", headers=auth())
    assert response.status_code == 422 and response.get_json()["code"], response.get_json()


def test_a_wait_past_the_services_maximum_ends_at_the_maximum(make_app):
    import time

    client = make_app(sync_timeout_max=0.3).test_client()
    job = submit(client).get_json()
    started = time.monotonic()
    polled = client.get(f"/v1/jobs/{job['id']}?wait=1000", headers=auth())
    assert polled.status_code == 200 and polled.get_json()["status"] == "queued"
    assert 0.25 < time.monotonic() - started < 5
    looked_up = client.post("/v1/jobs/lookup", json={"ids": [job["id"]], "wait": 1000}, headers=auth())
    assert looked_up.status_code == 200 and time.monotonic() - started < 10


def test_a_long_poll_of_another_keys_job_is_404_at_once(client):
    import time

    job = submit(client).get_json()
    started = time.monotonic()
    assert client.get(f"/v1/jobs/{job['id']}?wait=5", headers=auth(KEY_B)).status_code == 404
    assert time.monotonic() - started < 2


def test_many_jobs_read_in_one_request_name_what_is_not_the_callers(client):
    mine = [submit(client).get_json()["id"] for _ in range(3)]
    theirs = submit(client, key=KEY_B).get_json()["id"]
    ids = [mine[2], theirs, "job_doesnotexist", "not an id!", mine[0], mine[2]]
    response = client.post("/v1/jobs/lookup", json={"ids": ids}, headers=auth())
    assert response.status_code == 200
    body = response.get_json()
    assert [job["id"] for job in body["data"]] == [mine[2], mine[0]]  # in order, once each
    assert body["missing"] == [theirs, "job_doesnotexist", "not an id!"]
    assert all(job["status"] == "queued" for job in body["data"])


@pytest.mark.parametrize("body", [{}, {"ids": []}, {"ids": ["job_x"] * 1001}, {"ids": ["job_x"], "wait": -1},
                                  {"ids": "job_x"}])
def test_a_bad_lookup_is_a_422(client, body):
    response = client.post("/v1/jobs/lookup", json=body, headers=auth())
    assert response.status_code == 422 and response.get_json()["code"], response.get_json()


def test_a_lookup_with_wait_answers_once_every_job_has_ended(make_app):
    import threading
    import time

    app = make_app()
    client = app.test_client()
    ids = [submit(client).get_json()["id"] for _ in range(2)]
    jobs = app.extensions["rollout"].jobs

    def end_later() -> None:
        time.sleep(0.3)
        jobs.advance(ids[1], "succeeded", result={"choices": []})
        time.sleep(0.3)
        jobs.advance(ids[0], "cancelled")

    threading.Thread(target=end_later).start()
    started = time.monotonic()
    body = client.post("/v1/jobs/lookup", json={"ids": ids, "wait": 20}, headers=auth()).get_json()
    assert [job["status"] for job in body["data"]] == ["cancelled", "succeeded"]
    assert 0.5 < time.monotonic() - started < 10


def test_a_submit_no_replica_confirms_is_503_not_durable_and_names_the_job(make_app):
    """ROLLOUT_REDIS_REPLICA_ACKS: a 202 waits for replicas to hold the job (Redis WAIT); this Redis
    has none, so the job was created but is not durable: 503 with its id, never a 500."""
    client = make_app(redis_replica_acks=1, redis_replica_timeout_ms=50).test_client()
    response = submit(client, {"token_ids": [100] * 4, "sampling_params": {"max_tokens": 2}})
    body = response.get_json()
    assert response.status_code == 503 and body["code"] == "not_durable", body
    assert body["errors"]["replicas_acknowledged"] == 0 and body["errors"]["id"].startswith("job_")
    assert submit(make_app().test_client(), {"token_ids": [100] * 4}).status_code == 202  # 0: answered at once


def test_waiting_takes_no_connection_of_the_shared_pool(make_app):
    """Issue #47: 300 synchronous calls of one key took every Redis connection of the API process,
    and /healthz, other keys and the admin answered 503. Waits share one BLPOP of their own now
    (domain/infra/wakeup_hub.py): 60 long polls hold a few connections, and the rest answer."""
    import threading
    import time

    app = make_app(max_queued_per_key=100, api_threads=200)  # a key may hold 100 long polls
    services = app.extensions["rollout"]
    jobs = [submit(app.test_client()).get_json()["id"] for _ in range(60)]
    shared = services.redis.connection_pool
    before = shared._created_connections
    answers: list[str] = []
    polls = [threading.Thread(target=lambda job_id=job_id: answers.append(app.test_client().get(
        f"/v1/jobs/{job_id}?wait=20", headers=auth()).get_json()["status"])) for job_id in jobs]
    for poll in polls:
        poll.start()
    time.sleep(1.0)  # every poll is waiting by now
    client = app.test_client()
    assert client.get("/healthz").status_code in (200, 503)  # answers (no worker runs here), at once
    assert submit(client, key=KEY_B).status_code == 202
    # The polls' short reads as they start, not one connection held by each for its 20 s (60).
    assert shared._created_connections - before <= 20
    for job_id in jobs:
        services.jobs.advance(job_id, "cancelled")
    for poll in polls:
        poll.join(10)
    assert sorted(answers) == ["cancelled"] * 60


def test_a_key_holds_at_most_half_the_threads_in_long_polls_its_next_one_answers_at_once(make_app):
    import threading
    import time

    app = make_app(api_threads=4, max_queued_per_key=10)  # a key may hold 2 waiting reads
    mine = [submit(app.test_client()).get_json()["id"] for _ in range(3)]
    theirs = submit(app.test_client(), key=KEY_B).get_json()["id"]
    took: dict[str, float] = {}

    def poll(job_id: str, key: str = KEY_A) -> None:
        started = time.monotonic()
        app.test_client().get(f"/v1/jobs/{job_id}?wait=3", headers=auth(key))
        took[job_id] = time.monotonic() - started

    holding = [threading.Thread(target=poll, args=(job_id,)) for job_id in mine[:2]]
    for thread in holding:
        thread.start()
    time.sleep(0.5)
    poll(mine[2])  # a's third: at once, with the job as it is
    assert took[mine[2]] < 1.0, took
    other = threading.Thread(target=poll, args=(theirs, KEY_B))
    other.start()  # b's long poll still waits its 3 s: its own share
    for thread in (*holding, other):
        thread.join(10)
    assert all(took[job_id] >= 2.5 for job_id in (*mine[:2], theirs)), took
