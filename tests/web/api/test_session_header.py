"""An agent's session id reaches its job's stored request, from the native body's ``session_id`` or
the ``X-Session-ID`` header on any route (web/api/session_header.py); the GPU router reads it there
(tests/domain/infra/test_gpu_affinity.py). A bad header is a 422 with a code, never a 500."""

from __future__ import annotations

import json

import pytest

from domain.jobs.store import JobStore
from tests.web.conftest import auth

PROMPT = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "temperature": 0}}


def stored_session(redis_client, job_id: str) -> str | None:
    raw = redis_client.hget(JobStore.key(job_id), "request")
    return json.loads(raw).get("session_id")


def test_the_header_or_the_body_names_the_session_and_the_body_wins(client, redis_client):
    headed = client.post("/v1/jobs", json=PROMPT, headers={**auth(), "X-Session-ID": "traj-17"}).get_json()
    bodied = client.post("/v1/jobs", json={**PROMPT, "session_id": "traj-18"}, headers=auth()).get_json()
    both = client.post("/v1/jobs", json={**PROMPT, "session_id": "body"},
                       headers={**auth(), "X-Session-ID": "header"}).get_json()
    plain = client.post("/v1/jobs", json=PROMPT, headers=auth()).get_json()
    assert [stored_session(redis_client, job["id"]) for job in (headed, bodied, both, plain)] == \
        ["traj-17", "traj-18", "body", None]


BAD = ["x" * 257, "tab\there", "nul\u0000", "caf\u00e9", "\u00a0pad", "end "]


@pytest.mark.parametrize("value", BAD)
def test_a_bad_session_header_is_a_422_with_a_code(client, value):
    response = client.post("/v1/jobs", json=PROMPT, headers={**auth(), "X-Session-ID": value})
    assert response.status_code == 422
    assert response.get_json()["code"] == "invalid_request" and "X-Session-ID" in response.get_json()["errors"]


@pytest.mark.parametrize("value", ["", "\u0000", *BAD])
def test_the_body_session_id_follows_the_headers_rule(client, value):
    """A body's ``"\u0000"`` was stored while the header had to be printable: one rule for both."""
    response = client.post("/v1/jobs", json={**PROMPT, "session_id": value}, headers=auth())
    assert response.status_code == 422, response.get_json()
    assert response.get_json()["code"] == "invalid_request" and "session_id" in str(response.get_json()["errors"])
    assert client.get("/v1/jobs", headers=auth()).get_json()["data"] == []


def test_one_id_is_one_session_by_header_or_body(client, redis_client):
    value = "agent 7/turn-" + "x" * 243  # spaces inside, the longest
    jobs = [client.post("/v1/jobs", json=PROMPT, headers={**auth(), "X-Session-ID": value}).get_json(),
            client.post("/v1/jobs", json={**PROMPT, "session_id": value}, headers=auth()).get_json()]
    assert [stored_session(redis_client, job["id"]) for job in jobs] == [value, value]
