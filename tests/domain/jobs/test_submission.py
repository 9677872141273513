"""Submitting many jobs at once (domain/jobs/submission.submit_jobs) against real Redis servers."""

from __future__ import annotations

import json

import pytest
import redis
from kombu.exceptions import OperationalError

from domain.infra.redis_server import EmbeddedRedis
from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_jobs
from domain.names import PREPROCESS_QUEUE
from domain.settings import Settings
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery

OWNER = "key_submission"


def requests(count: int) -> list[tuple[JobRequest, None]]:
    return [(JobRequest.from_dict(stored_request(prompt=f"prompt {i}")), None) for i in range(count)]


@pytest.fixture
def broker(tmp_path):
    server = EmbeddedRedis(tmp_path / "broker", persistent=False).start()
    yield server
    server.stop()


def test_every_job_gets_its_message_in_order(jobs, broker, tmp_path):
    celery = create_celery(Settings(state_dir=tmp_path), broker.url)
    outcomes = submit_jobs(jobs, celery, owner=OWNER, requests=requests(5))
    with redis.Redis.from_url(broker.url) as client:
        queued = [json.loads(message)["headers"]["argsrepr"] for message in client.lrange(PREPROCESS_QUEUE, 0, -1)]
    assert list(reversed(queued)) == [repr([job["id"]]) for job in outcomes]  # LPUSH: the oldest at the tail
    assert jobs.active_count(OWNER) == 5


def test_messages_the_broker_refuses_fail_every_job_of_the_call(jobs, broker, tmp_path):
    """The broker answers but refuses the writes (out of memory): the publish batch fails as a
    whole, its jobs are failed (none holds a place under the caps) and the caller gets the error a
    failed publish always raised."""
    with redis.Redis.from_url(broker.url) as client:
        client.config_set("maxmemory", 1)
        client.config_set("maxmemory-policy", "noeviction")
    celery = create_celery(Settings(state_dir=tmp_path), broker.url)
    before = jobs.active_count(OWNER)
    with pytest.raises(OperationalError):
        submit_jobs(jobs, celery, owner=OWNER, requests=requests(3))
    assert jobs.active_count(OWNER) == before
    listed, _ = jobs.list(owner=OWNER, status=None, limit=10, cursor=None)
    assert len(listed) == 3 and {job["status"] for job in listed} == {"failed"}
    assert {job["error"]["code"] for job in listed} == {"service_unavailable"}
