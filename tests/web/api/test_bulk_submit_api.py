"""POST /v1/jobs/bulk against a real Redis and broker, without workers (jobs stay where the API left them)."""

from __future__ import annotations

import pytest

from domain.names import PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE
from tests.web.conftest import KEY_B, auth

GENERATE = {"token_ids": [100, 101, 102], "sampling_params": {"max_tokens": 4, "temperature": 0}}
SCORE = {"kind": "score", "token_ids": [100, 101], "completion_token_ids": [102, 103]}
TEXT = {"prompt": "hello there", "metadata": {"row": 7}}


def bulk(client, jobs, key=None):
    return client.post("/v1/jobs/bulk", json={"jobs": jobs}, headers=auth(key) if key else auth())


def queued_ids(redis_client, queue: str) -> list[str]:
    """The job ids of the Celery messages waiting in ``queue`` (the broker shares the API's Redis)."""
    import json

    return [json.loads(message)["headers"]["argsrepr"].strip("[]'\"") for message in redis_client.lrange(queue, 0, -1)]


def test_a_bulk_submit_creates_every_job_in_order_and_queues_each_once(client, redis_client):
    response = bulk(client, [GENERATE, SCORE, TEXT])
    assert response.status_code == 202, response.get_json()
    body = response.get_json()
    assert body["refused"] == [] and "Retry-After" not in response.headers
    jobs = body["data"]
    assert [job["kind"] for job in jobs] == ["generate", "score", "generate"]
    assert len({job["id"] for job in jobs}) == 3 and all(job["status"] == "queued" for job in jobs)
    for job in jobs:
        polled = client.get(job["links"]["self"], headers=auth()).get_json()
        assert polled["id"] == job["id"] and polled["status"] == "queued"
        assert client.get(job["links"]["self"], headers=auth(KEY_B)).status_code == 404  # the caller's alone
    assert client.get(jobs[2]["links"]["self"], headers=auth()).get_json()["metadata"] == {"row": 7}
    # Plain token prompts skip the CPU worker; a text prompt is tokenized there first.
    assert sorted(queued_ids(redis_client, SHARED_GENERATE_QUEUE)) == sorted([jobs[0]["id"], jobs[1]["id"]])
    assert queued_ids(redis_client, PREPROCESS_QUEUE) == [jobs[2]["id"]]


@pytest.mark.parametrize("body", [{}, {"jobs": []}, {"jobs": [GENERATE] * 1001}, {"jobs": GENERATE},
                                  {"jobs": [GENERATE, "x"]}, {"jobs": [GENERATE], "stream": True}])
def test_a_bad_bulk_body_is_a_422(client, body):
    response = client.post("/v1/jobs/bulk", json=body, headers=auth())
    assert response.status_code == 422 and response.get_json()["code"] == "invalid_request", response.get_json()


def test_an_invalid_request_names_its_place_and_nothing_is_created(client, redis_client):
    response = bulk(client, [GENERATE, {"token_ids": [-1]}, SCORE])
    assert response.status_code == 422
    assert "1" in response.get_json()["errors"]["jobs"]
    assert client.get("/v1/jobs", headers=auth()).get_json()["data"] == []
    assert redis_client.llen(SHARED_GENERATE_QUEUE) == 0


def test_a_request_the_limits_refuse_fails_the_call_with_its_own_code_and_place(client, redis_client):
    too_long = {"token_ids": [100] * 4, "sampling_params": {"max_tokens": 10**6}}
    out_of_vocabulary = {"token_ids": [100, 10**6]}
    for jobs, code in (([GENERATE, too_long], "context_length_exceeded"),
                       ([out_of_vocabulary, GENERATE], "token_id_out_of_range")):
        response = bulk(client, jobs)
        body = response.get_json()
        assert response.status_code == 422 and body["code"] == code, body
        index = jobs.index(too_long if code == "context_length_exceeded" else out_of_vocabulary)
        assert list(body["errors"]) == [f"jobs.{index}"] and body["message"].startswith(f"jobs.{index}: ")
    assert client.get("/v1/jobs", headers=auth()).get_json()["data"] == []
    assert redis_client.llen(SHARED_GENERATE_QUEUE) == 0


def test_the_queue_caps_refuse_what_does_not_fit_and_run_the_rest(make_app, redis_client):
    client = make_app(max_queued_per_key=2).test_client()
    response = bulk(client, [GENERATE, SCORE, TEXT])
    assert response.status_code == 202
    body = response.get_json()
    assert [job is None for job in body["data"]] == [False, False, True]
    assert [(entry["index"], entry["code"]) for entry in body["refused"]] == [(2, "queue_full")]
    assert int(response.headers["Retry-After"]) > 0
    assert redis_client.llen(SHARED_GENERATE_QUEUE) == 2 and redis_client.llen(PREPROCESS_QUEUE) == 0
    # Nothing fits: refused whole, as a single submit is.
    full = bulk(client, [GENERATE])
    assert full.status_code == 429 and full.get_json()["code"] == "queue_full" and int(full.headers["Retry-After"]) > 0
    assert bulk(client, [GENERATE], key=KEY_B).status_code == 202  # another key's place is its own


def test_a_bulk_submit_no_replica_confirms_is_503_naming_its_jobs(make_app):
    client = make_app(redis_replica_acks=1, redis_replica_timeout_ms=50).test_client()
    response = bulk(client, [GENERATE, SCORE])
    body = response.get_json()
    assert response.status_code == 503 and body["code"] == "not_durable", body
    ids = body["errors"]["id"].split(",")
    assert len(ids) == 2 and all(job_id.startswith("job_") for job_id in ids)


def test_a_broker_that_cannot_take_the_messages_is_a_503_and_no_job_lingers(make_app):
    """The job store answers but the messages cannot be published (the broker is away): 503, and
    the jobs made are failed, so none holds a place under the caps."""
    from domain.infra.redis_server import free_port
    from workers.celery_app import create_celery

    app = make_app()
    svc = app.extensions["rollout"]
    svc.celery = create_celery(svc.settings, f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    response = bulk(app.test_client(), [GENERATE, SCORE, TEXT])
    assert response.status_code == 503, response.get_json()
    assert response.get_json()["code"] == "redis_unavailable" and response.headers.get("Retry-After")
    assert svc.jobs.active_counts() == 0
    listed = app.test_client().get("/v1/jobs", headers=auth()).get_json()["data"]
    assert len(listed) == 3 and {job["status"] for job in listed} == {"failed"}


def test_a_dialect_batch_is_made_together_and_one_the_caps_refuse_cancels_the_others(make_app):
    """SGLang's batch /generate goes through the same bulk path: past the key's cap it answers the
    single submit's 429, and the jobs it had made are cancelled, none left holding a place."""
    app = make_app(max_queued_per_key=2)
    client = app.test_client()
    body = {"input_ids": [[100, 101], [100, 102], [100, 103]], "sampling_params": {"max_new_tokens": 2}}
    response = client.post("/generate", json=body, headers=auth())
    assert response.status_code == 429, response.get_json()
    assert response.get_json()["error"]["code"] == "queue_full"  # SGLang's error shape (web/dialects/errors.py)
    assert app.extensions["rollout"].jobs.active_counts() == 0
    listed = client.get("/v1/jobs", headers=auth()).get_json()["data"]
    assert len(listed) == 2 and {job["status"] for job in listed} == {"cancelled"}
