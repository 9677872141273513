"""Idempotency-Key on the native submits, against a real Redis and broker, without workers (jobs stay
queued): the same key and body answer the same jobs, once, whoever sends them at once."""

from __future__ import annotations

import http.client
import json
import threading
import uuid

import pytest

import web.api.idempotency
from domain.jobs.idempotency import CLAIM_TTL, IdempotencyStore
from domain.names import SHARED_GENERATE_QUEUE
from tests.conftest import empty_db_url
from tests.web.conftest import KEY_A, KEY_B, auth
from tests.web.gunicorn_api import gunicorn_api
from web.auth import key_id

GENERATE = {"token_ids": [100, 101, 102], "sampling_params": {"max_tokens": 4, "seed": 1}}
OTHER = {"token_ids": [100, 101, 103], "sampling_params": {"max_tokens": 4, "seed": 1}}


def keyed(key: str, api_key: str | None = None) -> dict[str, str]:
    return {**(auth(api_key) if api_key else auth()), "Idempotency-Key": key}


def job_ids(client, api_key: str | None = None) -> list[str]:
    listed = client.get("/v1/jobs?limit=100", headers=auth(api_key) if api_key else auth()).get_json()
    return [job["id"] for job in listed["data"]]


def test_the_same_key_and_body_answer_the_same_job_once(client, redis_client):
    key = str(uuid.uuid4())
    first = client.post("/v1/jobs", json=GENERATE, headers=keyed(key))
    assert first.status_code == 202, first.get_json()
    assert "Idempotent-Replayed" not in first.headers
    again = client.post("/v1/jobs", json=dict(reversed(GENERATE.items())), headers=keyed(key))  # field order aside
    assert again.status_code == 202, again.get_json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json()["id"] == first.get_json()["id"]
    assert again.headers["Location"] == first.headers["Location"]
    assert job_ids(client) == [first.get_json()["id"]]
    assert redis_client.llen(SHARED_GENERATE_QUEUE) == 1  # one message: the job runs once
    # Kept as long as the job's result, no longer.
    assert CLAIM_TTL < redis_client.ttl(IdempotencyStore.key(key_id(KEY_A), key)) <= 7 * 24 * 3600


def test_a_replay_shows_the_job_as_it_is_now(client):
    key = str(uuid.uuid4())
    job = client.post("/v1/jobs", json=GENERATE, headers=keyed(key)).get_json()
    client.delete(job["links"]["self"], headers=auth())
    again = client.post("/v1/jobs", json=GENERATE, headers=keyed(key)).get_json()
    assert (again["id"], again["status"]) == (job["id"], "cancelled")


def test_another_body_under_the_same_key_is_a_409_and_makes_nothing(client):
    key = str(uuid.uuid4())
    first = client.post("/v1/jobs", json=GENERATE, headers=keyed(key)).get_json()
    response = client.post("/v1/jobs", json=OTHER, headers=keyed(key))
    assert response.status_code == 409
    assert response.get_json()["code"] == "idempotency_key_reused"
    # The key names a submit to one route: the same body sent elsewhere is another submit.
    elsewhere = client.post("/v1/jobs/bulk", json={"jobs": [GENERATE]}, headers=keyed(key))
    assert elsewhere.status_code == 409 and elsewhere.get_json()["code"] == "idempotency_key_reused"
    assert job_ids(client) == [first["id"]]


def test_two_keys_holders_with_the_same_key_get_jobs_of_their_own(client):
    key = str(uuid.uuid4())
    a = client.post("/v1/jobs", json=GENERATE, headers=keyed(key))
    b = client.post("/v1/jobs", json=GENERATE, headers=keyed(key, KEY_B))
    assert a.status_code == b.status_code == 202
    assert "Idempotent-Replayed" not in b.headers
    assert a.get_json()["id"] != b.get_json()["id"]
    assert job_ids(client) == [a.get_json()["id"]] and job_ids(client, KEY_B) == [b.get_json()["id"]]
    # Another body under that key is B's own business: no 409 for A's.
    assert client.post("/v1/jobs", json=OTHER, headers=keyed(str(uuid.uuid4()), KEY_B)).status_code == 202


@pytest.mark.parametrize("value", ["", " ", "x" * 256, "has space", 'a"b', "a\\b", "caf\u00e9".encode().decode("latin-1"),
                                   "key-1,key-2", '"key-1","key-2"'])
def test_a_malformed_key_is_a_400_and_makes_nothing(client, value):
    response = client.post("/v1/jobs", json=GENERATE, headers=keyed(value))
    assert response.status_code == 400, response.get_json()
    assert response.get_json()["code"] == "invalid_idempotency_key"
    assert job_ids(client) == []


@pytest.mark.stack  # the API under gunicorn (README "Tests")
def test_two_key_headers_are_a_400_over_real_http(redis_url, demo_model_dir, tmp_path):
    """The server joins a field sent twice with a comma (RFC 9110, 5.3): two keys, read as the one
    key ``key-1,key-2``, made a job; a comma is no part of a key, so they are refused."""
    with gunicorn_api(empty_db_url(redis_url, 26), demo_model_dir, tmp_path) as (_, port):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.putrequest("POST", "/v1/jobs")
        for name, value in [*auth().items(), ("Content-Type", "application/json"),
                            ("Idempotency-Key", "key-1"), ("Idempotency-Key", "key-2")]:
            connection.putheader(name, value)
        body = json.dumps(GENERATE).encode()
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
    assert response.status == 400 and answer["code"] == "invalid_idempotency_key", answer


def test_the_drafts_quoted_form_names_the_same_key(client):
    key = str(uuid.uuid4())
    first = client.post("/v1/jobs", json=GENERATE, headers=keyed(f'"{key}"')).get_json()
    again = client.post("/v1/jobs", json=GENERATE, headers=keyed(key))
    assert again.headers["Idempotent-Replayed"] == "true" and again.get_json()["id"] == first["id"]
    assert client.post("/v1/jobs", json=GENERATE, headers=keyed("x" * 255)).status_code == 202


def test_identical_submits_at_once_make_one_job(make_app, redis_client):
    app = make_app()
    key, answers, start = str(uuid.uuid4()), [], threading.Barrier(8)

    def send():
        client = app.test_client()
        start.wait()
        response = client.post("/v1/jobs", json=GENERATE, headers=keyed(key))
        answers.append((response.status_code, response.get_json()["id"], "Idempotent-Replayed" in response.headers))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {status for status, _, _ in answers} == {202}
    assert len({job_id for _, job_id, _ in answers}) == 1
    assert sorted(replayed for _, _, replayed in answers) == [False] + [True] * 7
    assert job_ids(app.test_client()) == [answers[0][1]]
    assert redis_client.llen(SHARED_GENERATE_QUEUE) == 1


def test_a_submit_sent_while_its_first_is_still_being_made_is_a_retryable_409(client, redis_client, monkeypatch):
    first = client.post("/v1/jobs", json=GENERATE, headers=keyed(str(uuid.uuid4()))).get_json()
    # Another key whose first submit of the same body holds its claim and has not answered yet.
    [record] = [k for k in redis_client.keys("rq:idem:*")]
    key = str(uuid.uuid4())
    pending = IdempotencyStore.key(key_id(KEY_A), key)
    redis_client.hset(pending, mapping={"fingerprint": redis_client.hget(record, "fingerprint"), "claim": "another"})
    redis_client.expire(pending, CLAIM_TTL)
    monkeypatch.setattr(web.api.idempotency, "IN_USE_WAIT", 0.3)
    response = client.post("/v1/jobs", json=GENERATE, headers=keyed(key))
    assert response.status_code == 409 and response.headers["Retry-After"] == "1"
    assert response.get_json()["code"] == "idempotency_key_in_use"
    redis_client.delete(pending)  # that request died; its claim lapsed
    made = client.post("/v1/jobs", json=GENERATE, headers=keyed(key))
    assert made.status_code == 202 and made.get_json()["id"] != first["id"]


def test_a_submit_that_made_nothing_leaves_its_key_free(make_app):
    client = make_app(max_queued_per_key=1).test_client()
    key = str(uuid.uuid4())
    bad = client.post("/v1/jobs", json={"token_ids": [-1]}, headers=keyed(key))
    assert bad.status_code == 422
    blocker = client.post("/v1/jobs", json=OTHER, headers=auth()).get_json()
    refused = client.post("/v1/jobs", json=GENERATE, headers=keyed(key))
    assert refused.status_code == 429 and refused.get_json()["code"] == "queue_full"
    client.delete(blocker["links"]["self"], headers=auth())
    made = client.post("/v1/jobs", json=GENERATE, headers=keyed(key))  # sent again after Retry-After
    assert made.status_code == 202 and "Idempotent-Replayed" not in made.headers
    again = client.post("/v1/jobs", json=GENERATE, headers=keyed(key))
    assert again.get_json()["id"] == made.get_json()["id"]


def test_a_bulk_submit_sent_again_answers_the_same_jobs_and_refusals(make_app):
    client = make_app(max_queued_per_key=2).test_client()
    key, jobs = str(uuid.uuid4()), [GENERATE, OTHER, GENERATE]
    first = client.post("/v1/jobs/bulk", json={"jobs": jobs}, headers=keyed(key))
    assert first.status_code == 202
    body = first.get_json()
    assert [job is None for job in body["data"]] == [False, False, True] and body["refused"][0]["index"] == 2
    again = client.post("/v1/jobs/bulk", json={"jobs": jobs}, headers=keyed(key))
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Retry-After"] == first.headers["Retry-After"]
    replayed = again.get_json()
    assert [job and job["id"] for job in replayed["data"]] == [job and job["id"] for job in body["data"]]
    assert replayed["refused"] == body["refused"]
    assert len(job_ids(client)) == 2
    changed = client.post("/v1/jobs/bulk", json={"jobs": jobs[:2]}, headers=keyed(key))
    assert changed.status_code == 409 and changed.get_json()["code"] == "idempotency_key_reused"


def test_a_bulk_submit_refused_whole_leaves_its_key_free(make_app):
    client = make_app(max_queued_per_key=1).test_client()
    blocker = client.post("/v1/jobs", json=OTHER, headers=auth()).get_json()
    key = str(uuid.uuid4())
    assert client.post("/v1/jobs/bulk", json={"jobs": [GENERATE]}, headers=keyed(key)).status_code == 429
    client.delete(blocker["links"]["self"], headers=auth())
    made = client.post("/v1/jobs/bulk", json={"jobs": [GENERATE]}, headers=keyed(key))
    assert made.status_code == 202 and made.get_json()["data"][0] is not None


def test_a_synchronous_generate_sent_again_answers_the_same_job(client):
    key, body = str(uuid.uuid4()), {**GENERATE, "timeout": 0}
    first = client.post("/v1/generate", json=body, headers=keyed(key))
    assert first.status_code == 202  # no workers here: past its timeout, the job
    again = client.post("/v1/generate", json=body, headers=keyed(key))
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json()["id"] == first.get_json()["id"]
    assert job_ids(client) == [first.get_json()["id"]]
    assert client.post("/v1/generate", json={**body, "timeout": 1}, headers=keyed(key)).status_code == 409


def test_a_submit_without_a_key_is_made_every_time(client):
    ids = {client.post("/v1/jobs", json=GENERATE, headers=auth()).get_json()["id"] for _ in range(2)}
    assert len(ids) == 2


def test_the_openapi_document_names_the_header_and_its_answers(client):
    paths = client.get("/openapi.json").get_json()["paths"]
    for path in ("/v1/jobs", "/v1/jobs/bulk", "/v1/generate"):
        post = paths[path]["post"]
        assert "Idempotency-Key" in [parameter["name"] for parameter in post.get("parameters", [])], path
        assert {"400", "409"} <= set(post["responses"]), path
