"""Ending a job (domain.lifecycle) on its own: only the call that moves a job fires its follow-ups
(metrics, its batch line, its webhook task), once. Real Redis and a real broker; no worker
consumes, so the queued webhook messages are read straight from the queue."""

from __future__ import annotations

import base64
import json

import pytest

from domain.batches.store import BatchStore
from domain.jobs.attempts import FENCED, Fence
from domain.jobs.keys import WEBHOOK_OWED_KEY
from domain.lifecycle import cancel_job, end_fenced, end_job, end_jobs, fail_job, fail_unexpected
from domain.names import JOB_ENDED_TASK, WEBHOOKS_QUEUE
from domain.settings import Settings
from engine.errors import InvalidRequestError, NotFoundError
from tests.conftest import empty_db_url
from workers.celery_app import create_celery
from workers.gpu.jobs import poll_running
from workers.runtime import runtime

OWNER, DEFAULTED = "key_owner", "key_with_default_hook"
HOOK = {"url": "https://hooks.example.com/rollouts"}


@pytest.fixture
def rt(redis_url, tmp_path):
    settings = Settings(state_dir=tmp_path, key_webhooks={DEFAULTED: "https://hooks.example.com/default"})
    return runtime(create_celery(settings, empty_db_url(redis_url, 13)))


def new_job(rt, owner: str = OWNER, **fields) -> dict:
    webhook = fields.pop("webhook", None)
    return rt.jobs.create(owner=owner, kind="generate", request={"token_ids": [1]}, request_id=None,
                          webhook=webhook, extra=fields or None)


def webhook_messages(rt) -> list[str]:
    """The job ids of the queued ``job_ended`` webhook tasks, oldest first."""
    job_ids = []
    for raw in reversed(rt.redis.lrange(WEBHOOKS_QUEUE, 0, -1)):  # kombu LPUSHes
        message = json.loads(raw)
        assert message["headers"]["task"] == JOB_ENDED_TASK
        job_ids.append(json.loads(base64.b64decode(message["body"]))[0][0])
    return job_ids


def ended_counts(rt) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in rt.redis.hgetall("rq:metrics:jobs_ended").items()}


def test_only_the_call_that_ends_a_job_fires_its_followups(rt):
    job = new_job(rt, webhook=HOOK)
    assert end_job(rt, job["id"], "succeeded", job=job, result={"choices": []})
    assert not end_job(rt, job["id"], "succeeded", job=job, result={"choices": []})  # a redelivery
    assert not end_job(rt, job["id"], "failed")
    assert webhook_messages(rt) == [job["id"]]
    assert ended_counts(rt) == {"succeeded": 1}
    assert rt.jobs.get(job["id"])["result"] == {"choices": []}


def test_a_webhook_task_is_queued_only_when_one_is_wanted(rt):
    plain = new_job(rt)
    own_hook = new_job(rt, webhook=HOOK)
    owner_default = new_job(rt, owner=DEFAULTED)
    for job in (plain, own_hook, owner_default):
        assert end_job(rt, job["id"], "cancelled")  # the record is read back when not given
    assert webhook_messages(rt) == [own_hook["id"], owner_default["id"]]


def test_end_jobs_follows_up_the_jobs_it_moved(rt):
    ended_before = new_job(rt, webhook=HOOK)
    assert rt.jobs.advance(ended_before["id"], "cancelled", owner=OWNER)
    fresh = new_job(rt, webhook=HOOK)
    moved = end_jobs(rt, [(ended_before, "succeeded", {"result": {}}), (fresh, "succeeded", {"result": {}})])
    assert moved == [False, True]
    assert webhook_messages(rt) == [fresh["id"]]
    assert ended_counts(rt) == {"succeeded": 1}
    assert end_jobs(rt, []) == []


def test_failing_keeps_the_typed_code_and_hides_unexpected_causes(rt):
    typed, unexpected = new_job(rt), new_job(rt)
    assert fail_job(rt, typed["id"], InvalidRequestError("token_ids must not be empty"))
    try:
        raise RuntimeError("secret path /srv/models/x")
    except RuntimeError:
        assert fail_unexpected(rt, unexpected["id"], "generating")
    assert rt.jobs.get(typed["id"])["error"] == {"code": "invalid_request", "message": "token_ids must not be empty"}
    assert rt.jobs.get(unexpected["id"])["error"] == {"code": "internal_error",
                                                      "message": "internal error while generating"}
    assert not fail_job(rt, typed["id"], InvalidRequestError("again"))
    assert ended_counts(rt) == {"failed": 2}


def test_cancel_ends_a_waiting_job_and_asks_a_generating_one_to_abort(rt):
    waiting, generating = new_job(rt, webhook=HOOK), new_job(rt)
    assert rt.jobs.advance(generating["id"], "generating", owner=OWNER)
    assert cancel_job(rt, waiting["id"], owner=OWNER)["status"] == "cancelled"
    assert cancel_job(rt, generating["id"], owner=OWNER)["status"] == "generating"
    assert poll_running(rt.redis, [waiting["id"], generating["id"]], [])[0] == {generating["id"]}
    assert cancel_job(rt, waiting["id"], owner=OWNER)["status"] == "cancelled"  # idempotent
    assert webhook_messages(rt) == [waiting["id"]]
    with pytest.raises(NotFoundError):
        cancel_job(rt, generating["id"], owner="key_stranger")


def test_ending_a_batch_job_counts_its_line_once_and_ends_the_batch(rt):
    batches = BatchStore(rt.redis, result_ttl=600)
    batch = batches.create(owner=OWNER, total=1, chunk_size=8, completion_window=3600)
    assert batches.move(batch["id"], "in_progress", from_=("validating",))
    assert not batches.close_intake(batch["id"])  # its file read, no line ended yet
    job = new_job(rt, batch_id=batch["id"], custom_id="row-0", line="0")
    assert end_job(rt, job["id"], "succeeded", job=rt.jobs.get(job["id"]), result={"choices": []})
    end_job(rt, job["id"], "succeeded", result={"choices": []})
    ended = batches.get(batch["id"])
    assert (ended["status"], ended["completed"], ended["failed"]) == ("completed", 1, 0)
    [line] = [json.loads(item) for page in batches.iter_results(batch["id"], "output") for item in page]
    assert line["custom_id"] == "row-0" and line["response"]["body"] == {"choices": []}


def test_a_superseded_attempts_end_writes_nothing_and_fires_nothing(rt):
    job = new_job(rt, webhook=HOOK)
    assert rt.events.begin_attempts([job["id"]])[0].number == 1
    assert rt.events.begin_attempts([job["id"]])[0].number == 2  # another worker redid it meanwhile
    late, newest = Fence.generation(job["id"], 1), Fence.generation(job["id"], 2)
    assert end_fenced(rt, [(job, "succeeded", {"result": {"n": 1}})], [late]) == [FENCED]
    assert not fail_job(rt, job["id"], InvalidRequestError("late"), fence=late)
    assert rt.jobs.get(job["id"])["status"] == "queued"
    assert webhook_messages(rt) == [] and ended_counts(rt) == {}
    assert rt.redis.zscore(WEBHOOK_OWED_KEY, job["id"]) is None  # no debt recorded either
    assert end_fenced(rt, [(job, "succeeded", {"result": {"n": 2}})], [newest]) == [1]
    assert webhook_messages(rt) == [job["id"]]
    assert rt.jobs.get(job["id"])["result"] == {"n": 2}
