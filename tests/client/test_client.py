"""The Python client's retries and errors against a scripted loopback HTTP server.

The client against the real service (API, Celery workers, model) is in tests/e2e/test_client_e2e.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from email.utils import formatdate

import pytest
from rollout_queue_client import (
    ClientError,
    ConnectionFailedError,
    RetryPolicy,
    RolloutClient,
    WaitTimeoutError,
)
from rollout_queue_client.retry import parse_retry_after

KEY = "client-test-key"
PROMPT = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
RESULT = {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "token_ids": [9], "finish_reason": "length"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
FAST = RetryPolicy(backoff=0.01, jitter=0.0)


def test_429_and_503_are_retried_honouring_retry_after(scripted):
    scripted.script.extend([
        (429, {"Retry-After": "1"}, {"code": "queue_full", "message": "too many"}),
        (503, {"Retry-After": "0"}, {"code": "redis_unavailable", "message": "retry"}),
        (202, {}, {"id": "job_1", "status": "queued"}),
    ])
    job = RolloutClient(scripted.url, api_key="k", retry=FAST).submit(PROMPT)
    assert job == {"id": "job_1", "status": "queued"}
    assert [seen[1:3] for seen in scripted.seen] == [("POST", "/v1/jobs")] * 3
    assert json.loads(scripted.seen[2][3]) == PROMPT  # the same body every time
    first, second = scripted.gaps()
    assert first >= 0.95 and second < 0.5


def test_without_retry_after_the_backoff_doubles(scripted):
    scripted.script.extend([(503, {}, b"busy")] * 3 + [(200, {}, {"id": "job_1", "status": "queued"})])
    client = RolloutClient(scripted.url, retry=RetryPolicy(backoff=0.1, jitter=0.0))
    assert client.get("job_1")["id"] == "job_1"
    gaps = scripted.gaps()
    assert len(gaps) == 3
    for gap, expected in zip(gaps, (0.1, 0.2, 0.4), strict=True):
        assert expected - 0.01 <= gap < expected + 0.3


def test_retries_run_out_into_a_typed_error(scripted):
    scripted.script.append((429, {"Retry-After": "0"}, {"code": "queue_full", "message": "too many unfinished jobs"}))
    with pytest.raises(ClientError) as raised:
        RolloutClient(scripted.url, retry=RetryPolicy(max_retries=2, backoff=0.01)).submit(PROMPT)
    error = raised.value
    assert (error.code, error.status, error.message) == ("queue_full", 429, "too many unfinished jobs")
    assert error.retryable and len(scripted.seen) == 3


def test_error_bodies_become_client_errors(scripted):
    scripted.script.extend([
        (422, {}, {"code": "invalid_request", "message": "invalid fields: tokens", "errors": {"tokens": ["x"]}}),
        (502, {"Content-Type": "text/html"}, b"<html>bad gateway</html>"),
    ])
    client = RolloutClient(scripted.url, retry=FAST)
    with pytest.raises(ClientError) as invalid:
        client.submit({"tokens": [1]})
    assert (invalid.value.code, invalid.value.status, invalid.value.errors) == (
        "invalid_request", 422, {"tokens": ["x"]})
    assert not invalid.value.retryable
    with pytest.raises(ClientError) as gateway:
        client.get("job_1")
    assert (gateway.value.code, gateway.value.status) == ("http_502", 502)


def test_an_unreachable_service_is_a_connection_error(scripted):
    url = scripted.url
    scripted.server.shutdown()
    scripted.server.server_close()
    with pytest.raises(ConnectionFailedError) as raised:
        RolloutClient(url, retry=FAST).submit(PROMPT)
    assert raised.value.code == "connection_error" and raised.value.status is None


def test_retry_after_accepts_seconds_and_http_dates():
    assert parse_retry_after("7") == 7.0
    assert 25 < parse_retry_after(formatdate(time.time() + 30, usegmt=True)) <= 30
    assert parse_retry_after(formatdate(time.time() - 30, usegmt=True)) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    assert RetryPolicy(max_delay=5).delay(1, "3600") == 5


def test_the_client_imports_without_the_service_stack():
    code = ("import sys, rollout_queue_client; bad = [m for m in ('flask', 'torch', 'transformers', 'celery', 'web', "
            "'workers', 'processors', 'engine') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_batch_wait_long_polls_each_request_for_a_poll_interval(scripted):
    running = {"id": "batch_1", "status": "in_progress", "request_counts": {"total": 2, "completed": 1, "failed": 0}}
    scripted.script.extend([(200, {}, running), (200, {}, {**running, "status": "completed"})])
    seen = []
    done = RolloutClient(scripted.url).batch_wait("batch_1", poll_interval=0.2, progress=seen.append)
    assert done["status"] == "completed" and [b["status"] for b in seen] == ["in_progress", "completed"]
    assert [path for _, _, path, _ in scripted.seen] == ["/v1/batches/batch_1?wait=0.2"] * 2


def test_a_wait_the_service_cuts_short_is_retried_after_the_interval(scripted):
    # This server answers at once (as a service whose ROLLOUT_SYNC_TIMEOUT_MAX is below the wait).
    scripted.script.append((200, {}, {"id": "job_1", "status": "running"}))
    with pytest.raises(WaitTimeoutError):
        RolloutClient(scripted.url).wait("job_1", timeout=0.5, poll_interval=0.2)
    assert 2 <= len(scripted.seen) <= 4  # paced by poll_interval (clamped to the deadline), not a spin


def test_submit_many_sends_again_only_what_the_caps_refused_and_keeps_the_order(scripted):
    first = {"data": [{"id": "job_a"}, None, {"id": "job_c"}, None],
             "refused": [{"index": 1, "code": "queue_full", "message": "full"},
                         {"index": 3, "code": "queue_full", "message": "full"}]}
    second = {"data": [{"id": "job_b"}, {"id": "job_d"}], "refused": []}
    scripted.script.extend([(202, {"Retry-After": "1"}, first), (202, {}, second)])
    requests = [{**PROMPT, "metadata": {"row": row}} for row in range(4)]
    jobs = RolloutClient(scripted.url, retry=FAST).submit_many(requests)
    assert [job["id"] for job in jobs] == ["job_a", "job_b", "job_c", "job_d"]
    sent = [json.loads(body)["jobs"] for _, _, _, body in scripted.seen]
    assert [path for _, _, path, _ in scripted.seen] == ["/v1/jobs/bulk"] * 2
    assert sent == [requests, [requests[1], requests[3]]]
    assert scripted.gaps()[0] >= 0.95  # the service's Retry-After, not the policy's backoff


def test_submit_many_splits_past_the_bulk_limit_and_reports_what_ran_when_retries_run_out(scripted, monkeypatch):
    monkeypatch.setattr("rollout_queue_client.client.BULK_JOBS", 2)
    scripted.script.extend([
        (202, {}, {"data": [{"id": "job_a"}, {"id": "job_b"}], "refused": []}),
        (202, {"Retry-After": "0"}, {"data": [None], "refused": [{"index": 0, "code": "queue_full", "message": "x"}]}),
    ])
    with pytest.raises(ClientError) as raised:
        RolloutClient(scripted.url, retry=RetryPolicy(max_retries=1, backoff=0.01)).submit_many([PROMPT] * 3)
    error = raised.value
    assert (error.code, error.status) == ("queue_full", 429)
    assert error.errors["jobs"] == [{"id": "job_a"}, {"id": "job_b"}, None]
    assert [len(json.loads(body)["jobs"]) for _, _, _, body in scripted.seen] == [2, 1, 1]


def test_wait_many_long_polls_asking_again_only_for_the_jobs_still_running(scripted):
    running = [{"id": "job_a", "status": "running"}, {"id": "job_b", "status": "running"}]
    scripted.script.extend([
        (200, {}, {"data": running, "missing": []}),
        (200, {}, {"data": [{"id": "job_a", "status": "succeeded"}, running[1]], "missing": []}),
        (200, {}, {"data": [{"id": "job_b", "status": "failed"}], "missing": []}),
    ])
    jobs = RolloutClient(scripted.url).wait_many(["job_a", "job_b", "job_a"], poll_interval=0.2)
    assert [job["id"] for job in jobs] == ["job_a", "job_b", "job_a"] and jobs[1]["status"] == "failed"
    asked = [json.loads(body) for _, _, _, body in scripted.seen]
    assert [body["ids"] for body in asked] == [["job_a", "job_b"], ["job_a", "job_b"], ["job_b"]]
    assert all(body["wait"] > 0 for body in asked)
    # This server answers at once: a wait cut short with nothing ended is paced, one that ended a job is not.
    first, second = scripted.gaps()
    assert first >= 0.15 and second < 0.15


def test_wait_many_names_ids_that_are_no_job_and_times_out(scripted):
    scripted.script.append((200, {}, {"data": [], "missing": ["job_x"]}))
    with pytest.raises(ClientError) as missing:
        RolloutClient(scripted.url).wait_many(["job_x"])
    assert (missing.value.code, missing.value.errors) == ("not_found", {"missing": ["job_x"]})
    scripted.script.clear()
    scripted.script.append((200, {}, {"data": [{"id": "job_a", "status": "running"}], "missing": []}))
    with pytest.raises(WaitTimeoutError):
        RolloutClient(scripted.url).wait_many(["job_a"], timeout=0.5, poll_interval=0.2)


def test_each_submit_sends_a_key_of_its_own_and_keeps_it_when_sent_again(scripted):
    scripted.script.extend([
        (503, {"Retry-After": "0"}, {"code": "redis_unavailable", "message": "retry"}),
        (409, {"Retry-After": "0"}, {"code": "idempotency_key_in_use", "message": "still being made"}),
        (202, {}, {"id": "job_1", "status": "queued"}),
        (202, {}, {"id": "job_2", "status": "queued"}),
    ])
    client = RolloutClient(scripted.url, retry=FAST)
    assert client.submit(PROMPT)["id"] == "job_1"
    assert client.submit(PROMPT)["id"] == "job_2"
    keys = [headers["Idempotency-Key"] for headers in scripted.headers]
    assert len(keys) == 4 and keys[0] == keys[1] == keys[2] != keys[3]
    assert str(uuid.UUID(keys[0])) == keys[0]


def test_a_409_for_another_body_is_not_sent_again(scripted):
    scripted.script.append((409, {}, {"code": "idempotency_key_reused", "message": "another body"}))
    with pytest.raises(ClientError) as raised:
        RolloutClient(scripted.url, retry=FAST).submit(PROMPT)
    assert (raised.value.code, raised.value.status) == ("idempotency_key_reused", 409) and len(scripted.seen) == 1
