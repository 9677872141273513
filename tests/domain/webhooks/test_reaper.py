"""The sweep that sends again the webhook messages a crash lost (domain.webhooks.reaper), against
a real Redis and broker. No worker consumes: messages are read straight from the queue."""

from __future__ import annotations

import base64
import json

import pytest

from domain.lifecycle import end_job
from domain.names import DELIVER_TASK, JOB_ENDED_TASK, WEBHOOKS_QUEUE
from domain.settings import Settings
from domain.webhooks import RETRYING, SUCCEEDED, Outcome
from domain.webhooks.emit import emit_job_event
from domain.webhooks.reaper import WebhookReaper
from domain.webhooks.store import OPEN_KEY, OWED_KEY
from tests.conftest import empty_db_url
from workers.celery_app import create_celery
from workers.runtime import runtime

OWNER = "key_owner"
HOOK = {"url": "https://hooks.example.com/rollouts"}


@pytest.fixture
def rt(redis_url, tmp_path):
    return runtime(create_celery(Settings(state_dir=tmp_path), empty_db_url(redis_url, 27)))


@pytest.fixture
def reaper(rt):
    return WebhookReaper(rt, stall_s=0)  # every debt is a candidate at once; only the carriers decide


def ended_job(rt) -> dict:
    """A job that ended, as Redis holds it when its job_ended message was lost on its way."""
    job = rt.jobs.create(owner=OWNER, kind="generate", request={"token_ids": [1]}, request_id=None, webhook=HOOK)
    rt.jobs.advance(job["id"], "succeeded", owner=OWNER, result={})  # records the webhook debt
    return rt.jobs.get(job["id"])


def queued(rt) -> list[tuple[str, list, dict]]:
    """(task, args, kwargs) of each message waiting in the webhooks queue, oldest first."""
    found = []
    for raw in reversed(rt.redis.lrange(WEBHOOKS_QUEUE, 0, -1)):  # kombu LPUSHes
        message = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        found.append((message["headers"]["task"], args, kwargs))
    return found


def test_an_ended_job_whose_job_ended_message_was_lost_gets_it_again(rt, reaper):
    job = ended_job(rt)
    assert reaper.sweep() == ([], [])  # missed once: it may be between a pop and its record
    assert reaper.sweep() == ([job["id"]], [])
    assert queued(rt) == [(JOB_ENDED_TASK, [job["id"]], {})]
    assert reaper.sweep() == ([], []) and len(queued(rt)) == 1  # carried now


def test_a_job_whose_job_ended_message_is_queued_is_left_alone(rt, reaper):
    job = rt.jobs.create(owner=OWNER, kind="generate", request={"token_ids": [1]}, request_id=None, webhook=HOOK)
    assert end_job(rt, job["id"], "succeeded", result={})  # owes the event, then sends job_ended
    assert rt.redis.zscore(OWED_KEY, job["id"]) is not None
    assert reaper.sweep() == ([], []) and reaper.sweep() == ([], [])
    assert queued(rt) == [(JOB_ENDED_TASK, [job["id"]], {})]


def test_making_the_event_settles_the_debt_and_opens_the_event(rt):
    job = ended_job(rt)
    started = []
    event_id = emit_job_event(rt, job, first_attempt=started.append)
    assert started == [event_id]
    assert rt.redis.zscore(OWED_KEY, job["id"]) is None and rt.redis.zscore(OPEN_KEY, event_id) is not None


def test_a_debt_stays_while_the_primary_does_not_hold_its_event(rt, reaper):
    """A split brain: the event was made on an old primary that still took writes (a connection
    made before the failover), the debt settled on the new one. The debt stays, and the job's end
    is sent again, which makes the event where it now lives."""
    job = ended_job(rt)
    assert not rt.webhooks.settle(job["id"], "msg_" + "A" * 22)  # an event this primary never saw
    assert rt.redis.zscore(OWED_KEY, job["id"]) is not None
    reaper.sweep()
    assert reaper.sweep() == ([job["id"]], []) and queued(rt) == [(JOB_ENDED_TASK, [job["id"]], {})]
    event_id = emit_job_event(rt, job, first_attempt=lambda _: None)
    assert rt.redis.zscore(OWED_KEY, job["id"]) is None and rt.webhooks.get(event_id) is not None


def test_an_event_whose_next_attempt_was_lost_is_attempted_again(rt, reaper):
    job = ended_job(rt)
    event_id = emit_job_event(rt, job, first_attempt=lambda _: None)
    store = rt.webhooks
    assert store.claim(event_id, 1, "attempt-1")
    store.record(event_id, 1, Outcome(RETRYING, 503, "webhook_http_error"), 0.01, at=0.0, next_delay=1.0)
    assert store.claim(event_id, 2, "a-message-lost-with-its-worker")  # sent, then lost before recording
    assert reaper.sweep() == ([], [])
    assert reaper.sweep() == ([], [event_id])
    assert queued(rt) == [(DELIVER_TASK, [event_id], {"attempt": 2})]
    assert not store.claimed(event_id, 2)  # the new message may take attempt 2
    assert reaper.sweep() == ([], [])


def test_a_pending_event_whose_job_ended_task_runs_it_is_left_alone(rt, reaper):
    job = ended_job(rt)
    emit_job_event(rt, job, first_attempt=lambda _: None)
    rt.celery.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)  # attempt 1 runs in it
    assert reaper.sweep() == ([], []) and reaper.sweep() == ([], [])
    assert len(queued(rt)) == 1


def test_a_final_event_leaves_the_open_index(rt, reaper):
    event_id = emit_job_event(rt, ended_job(rt), first_attempt=lambda _: None)
    rt.webhooks.record(event_id, 1, Outcome(SUCCEEDED, 200, None), 0.01, at=0.0, next_delay=None)
    assert rt.redis.zscore(OPEN_KEY, event_id) is None
    assert reaper.sweep() == ([], []) and reaper.sweep() == ([], []) and queued(rt) == []

