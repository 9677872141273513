"""A preprocess task past its hard time limit fails its job with ``job_time_limit_exceeded``.

Celery kills the pool process and calls the request's ``on_timeout`` in the worker's main process;
nothing of the task runs. Here that call is made on a real request, built from the real message
that submitting the job queued (real Redis and broker; the pool and its kill are Celery's own).
"""

from __future__ import annotations

import pytest

from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_job
from domain.names import PREPROCESS_QUEUE, PREPROCESS_TASK
from domain.settings import Settings
from tests.conftest import empty_db_url
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.runtime import runtime
from workers.tasks.cpu import PreprocessRequest

OWNER = "key_owner"


@pytest.fixture
def app(redis_url, tmp_path):
    url = empty_db_url(redis_url, 9)
    return create_celery(Settings(state_dir=tmp_path), url)


def queued_request(app) -> PreprocessRequest:
    with app.connection_for_read() as connection:
        message = connection.default_channel.basic_get(PREPROCESS_QUEUE)
        assert message is not None and message.headers["task"] == PREPROCESS_TASK
        return app.tasks[PREPROCESS_TASK].Request(message, app=app, task=app.tasks[PREPROCESS_TASK])


def submit(rt) -> str:
    request = JobRequest.from_dict(stored_request(prompt="hello", sampling_params={"max_tokens": 1}))
    return submit_job(rt.jobs, rt.celery, owner=OWNER, request=request)["id"]


def test_the_preprocess_task_uses_the_request_that_handles_timeouts(app):
    assert app.tasks[PREPROCESS_TASK].Request is PreprocessRequest


def test_hard_time_limit_fails_the_job_with_its_code(app):
    rt = runtime(app)
    job_id = submit(rt)
    rt.jobs.advance(job_id, "preprocessing")
    queued_request(app).on_timeout(soft=False, timeout=8)
    job = rt.jobs.get(job_id)
    assert job["status"] == "failed"
    assert job["error"]["code"] == "job_time_limit_exceeded" and "8" in job["error"]["message"]


def test_soft_time_limit_leaves_the_job_to_the_task(app):
    rt = runtime(app)
    job_id = submit(rt)
    rt.jobs.advance(job_id, "preprocessing")
    queued_request(app).on_timeout(soft=True, timeout=6)  # the task itself gets the exception
    assert rt.jobs.get(job_id)["status"] == "preprocessing"
