"""A job that ended without its follow-ups (Redis went away between ending it and queueing its
webhook) gets them when its message comes back: the CPU and GPU tasks redo them for a job they
find ended. Real Redis and a real broker; the task bodies run here, no worker consumes."""

from __future__ import annotations

import base64
import json

import pytest

from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_job
from domain.lifecycle import resume_followups
from domain.names import JOB_ENDED_TASK, WEBHOOKS_QUEUE
from domain.settings import Settings
from tests.conftest import empty_db_url
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.gpu.jobs import open_jobs
from workers.runtime import runtime
from workers.tasks.cpu import _preprocess

OWNER = "key_owner"
HOOK = {"url": "https://hooks.example.com/rollouts"}
RESULT = {"prompt_token_ids": [100], "choices": [{"index": 0, "token_ids": [101], "finish_reason": "length"}]}


@pytest.fixture
def app(redis_url, tmp_path):
    url = empty_db_url(redis_url, 8)
    return create_celery(Settings(state_dir=tmp_path), url)


def ended_without_followups(rt, **request) -> str:
    """A job as Redis holds it when the outage hit right after the end: ended, nothing queued."""
    job = submit_job(rt.jobs, rt.celery, owner=OWNER, request=JobRequest.from_dict(stored_request(
        token_ids=[100, 101], sampling_params={"max_tokens": 1}, **request)))
    assert rt.jobs.advance(job["id"], "succeeded", owner=OWNER, result=RESULT)
    return job["id"]


def queued_webhook_jobs(rt) -> list[str]:
    job_ids = []
    for raw in rt.redis.lrange(WEBHOOKS_QUEUE, 0, -1):
        message = json.loads(raw)
        assert message["headers"]["task"] == JOB_ENDED_TASK
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        job_ids.append(args[0])
    return job_ids


def test_preprocess_task_queues_the_webhook_of_a_job_it_finds_ended(app):
    rt = runtime(app)
    job_id = ended_without_followups(rt, webhook=HOOK)
    assert queued_webhook_jobs(rt) == []
    _preprocess(app, job_id, retry_handles=False)
    assert queued_webhook_jobs(rt) == [job_id]


def test_generate_task_queues_the_webhooks_of_jobs_it_finds_ended(app):
    rt = runtime(app)
    with_hook = ended_without_followups(rt, webhook=HOOK)
    without_hook = ended_without_followups(rt)
    assert open_jobs(rt, [with_hook, without_hook], device="cpu") == ([], [with_hook, without_hook])
    assert queued_webhook_jobs(rt) == [with_hook]


def test_followups_are_not_counted_again(app):
    rt = runtime(app)
    job_id = ended_without_followups(rt, webhook=HOOK)
    ended_before = rt.redis.hgetall("rq:metrics:jobs_ended")
    resume_followups(rt, [rt.jobs.get(job_id)])
    assert rt.redis.hgetall("rq:metrics:jobs_ended") == ended_before
    # A job still running has no follow-ups to redo.
    running = submit_job(rt.jobs, rt.celery, owner=OWNER, request=JobRequest.from_dict(stored_request(
        token_ids=[100], sampling_params={"max_tokens": 1}, webhook=HOOK)))
    resume_followups(rt, [rt.jobs.get(running["id"])])
    assert queued_webhook_jobs(rt) == [job_id]
