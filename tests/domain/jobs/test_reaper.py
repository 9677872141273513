"""The sweep that queues again the jobs no message carries (domain.jobs.reaper), against a real
Redis and broker. No worker consumes: messages are read straight from the queues, and one is held
unacknowledged the way a worker holds it (kombu's basic_get without an ack)."""

from __future__ import annotations

import base64
import json

import pytest

from domain.infra.heartbeats import beat
from domain.jobs.keys import UNFINISHED_KEY
from domain.jobs.prompt_codec import text_prompt
from domain.jobs.reaper import AFTER_DEATH_SWEEPS, AfterDeathReaper, JobReaper
from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_job
from domain.names import (
    GENERATE_TASK,
    PREPROCESS_QUEUE,
    PREPROCESS_TASK,
    SHARED_GENERATE_QUEUE,
    node_generate_queue,
)
from domain.settings import Settings
from tests.conftest import empty_db_url
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.runtime import runtime

OWNER = "key_owner"


@pytest.fixture
def rt(redis_url, tmp_path):
    return runtime(create_celery(Settings(state_dir=tmp_path, cpu_per_key=1), empty_db_url(redis_url, 26)))


@pytest.fixture
def reaper(rt):
    # stall_s=0: every unfinished job is a candidate at once; only the carriers decide.
    return JobReaper(rt, stall_s=0)


def new_job(rt, prompt: dict | None = None) -> str:
    """A stored job whose message was lost: nothing was published for it."""
    return rt.jobs.create(owner=OWNER, kind="generate", request={"token_ids": [1, 2]}, request_id=None,
                          prompt=json.dumps(prompt) if prompt else None)["id"]


def prompt_request(prompt: str) -> JobRequest:
    return JobRequest.from_dict(stored_request(prompt=prompt))


def queued(rt, queue: str) -> list[tuple[str, str, dict]]:
    """(task, job id, kwargs) of each message waiting in ``queue``, oldest first."""
    found = []
    for raw in reversed(rt.redis.lrange(queue, 0, -1)):  # kombu LPUSHes
        message = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        found.append((message["headers"]["task"], args[0], kwargs))
    return found


def test_a_job_no_message_carries_is_queued_again_on_the_second_sweep_that_misses_it(rt, reaper):
    job_id = new_job(rt)
    assert reaper.sweep() == []  # missed once: it may be between a pop and its record
    assert queued(rt, PREPROCESS_QUEUE) == []
    assert reaper.sweep() == [job_id]
    assert queued(rt, PREPROCESS_QUEUE) == [(PREPROCESS_TASK, job_id, {"retry_handles": False})]
    # Now carried: later sweeps leave it alone.
    assert reaper.sweep() == [] and reaper.sweep() == []
    assert len(queued(rt, PREPROCESS_QUEUE)) == 1


def test_a_job_found_again_before_the_second_sweep_is_not_queued_twice(rt, reaper):
    job_id = new_job(rt)
    assert reaper.sweep() == []
    rt.celery.send_task(PREPROCESS_TASK, args=[job_id], queue=PREPROCESS_QUEUE)  # its record landed late
    assert reaper.sweep() == [] and reaper.sweep() == []
    assert len(queued(rt, PREPROCESS_QUEUE)) == 1


def test_jobs_with_a_queued_message_are_left_alone(rt, reaper):
    job_ids = [submit_job(rt.jobs, rt.celery, owner=OWNER, request=prompt_request(f"p{i}"))["id"] for i in range(3)]
    assert reaper.sweep() == [] and reaper.sweep() == []
    assert [job_id for _, job_id, _ in queued(rt, PREPROCESS_QUEUE)] == job_ids


def test_a_job_whose_message_a_worker_holds_unacknowledged_is_left_alone(rt, reaper):
    job_id = submit_job(rt.jobs, rt.celery, owner=OWNER, request=prompt_request("held"))["id"]
    with rt.celery.connection_for_read() as connection:
        channel = connection.channel()
        held = channel.basic_get(PREPROCESS_QUEUE, no_ack=False)  # recorded in kombu's unacked hash
        assert held is not None and queued(rt, PREPROCESS_QUEUE) == []
        assert job_id.encode() in rt.redis.hvals("unacked")[0]
        assert reaper.sweep() == [] and reaper.sweep() == []
        assert queued(rt, PREPROCESS_QUEUE) == []


def test_a_job_parked_by_the_fair_share_is_left_alone(rt, reaper):
    share = rt.share("cpu")
    assert share.acquire(OWNER, "job_holding_the_only_slot")
    job_id = new_job(rt)
    assert not share.acquire_or_park(OWNER, job_id, task=PREPROCESS_TASK, args=[job_id],
                                     kwargs={"retry_handles": False}, queue=PREPROCESS_QUEUE)
    assert reaper.sweep() == [] and reaper.sweep() == []
    assert queued(rt, PREPROCESS_QUEUE) == []


def test_a_job_with_a_stored_prompt_gets_its_generate_message_on_the_queue_that_can_open_it(rt, reaper):
    inline = new_job(rt, text_prompt([5, 6]))
    on_node = new_job(rt, {**text_prompt([7]), "transport": "shm", "node_id": "node-a"})
    reaper.sweep()
    assert sorted(reaper.sweep()) == sorted([inline, on_node])
    assert queued(rt, SHARED_GENERATE_QUEUE) == [(GENERATE_TASK, inline, {})]
    assert queued(rt, node_generate_queue("node-a")) == [(GENERATE_TASK, on_node, {})]
    assert queued(rt, PREPROCESS_QUEUE) == []
    assert reaper.sweep() == []  # both carried now, the node queue read too


def test_a_generating_job_without_its_prompt_is_preprocessed_again_for_new_handles(rt, reaper):
    job_id = new_job(rt)
    rt.jobs.advance(job_id, "generating", owner=OWNER)
    reaper.sweep()
    assert reaper.sweep() == [job_id]
    assert queued(rt, PREPROCESS_QUEUE) == [(PREPROCESS_TASK, job_id, {"retry_handles": True})]


def test_only_jobs_that_have_not_moved_for_the_stall_period_are_looked_at(rt):
    job_id = new_job(rt)
    patient = JobReaper(rt, stall_s=3600)
    assert patient.sweep() == [] and patient.sweep() == []
    assert queued(rt, PREPROCESS_QUEUE) == []
    assert rt.jobs.stalled(before=float("inf"), limit=10) == [job_id]


def test_the_unfinished_index_follows_every_move_and_drops_ended_jobs(rt, reaper):
    job_id = new_job(rt)
    created = rt.redis.zscore(UNFINISHED_KEY, job_id)
    rt.jobs.advance(job_id, "preprocessing", owner=OWNER)
    assert rt.redis.zscore(UNFINISHED_KEY, job_id) >= created
    rt.jobs.advance(job_id, "succeeded", owner=OWNER, result={})
    assert rt.redis.zscore(UNFINISHED_KEY, job_id) is None
    # A record gone from under the index (expired, deleted by hand) is dropped by the sweep.
    vanished = new_job(rt)
    rt.redis.delete(rt.jobs.key(vanished))
    assert reaper.sweep() == [] and reaper.sweep() == []
    assert rt.redis.zcard(UNFINISHED_KEY) == 0


def test_a_long_carried_backlog_is_worked_through_in_turns(rt, reaper, monkeypatch):
    monkeypatch.setattr("domain.jobs.reaper.MAX_CANDIDATES", 2)
    carried = [submit_job(rt.jobs, rt.celery, owner=OWNER, request=prompt_request(f"p{i}"))["id"] for i in range(2)]
    lost = new_job(rt)  # the newest: behind the two carried ones
    assert reaper.sweep() == []  # looked at the two oldest, found them carried, moved them back
    assert reaper.sweep() == []  # now the lost one is among the oldest: a suspect
    assert reaper.sweep() == [lost]
    assert [job_id for _, job_id, _ in queued(rt, PREPROCESS_QUEUE)] == [*carried, lost]


def test_a_dead_workers_lost_message_is_sent_again_within_two_sweeps_of_its_heartbeat_going(rt):
    after_death = AfterDeathReaper(rt)
    beat(rt.redis, "gpu", "node-1-41", {})
    beat(rt.redis, "cpu", "node-1-42", {})
    lost = new_job(rt)  # what the worker popped and never recorded; just now, nowhere near stalled
    assert after_death.sweep() == [] and after_death.sweep() == []  # every worker alive: not looked for
    rt.redis.delete("rq:worker:gpu:node-1-41")  # killed: its heartbeat lapses
    assert after_death.sweep() == []  # missed once: it may be between a pop and its record
    assert after_death.sweep() == [lost]
    assert queued(rt, PREPROCESS_QUEUE) == [(PREPROCESS_TASK, lost, {"retry_handles": False})]


def test_the_sweeps_after_a_death_stop_after_a_few(rt):
    after_death = AfterDeathReaper(rt)
    beat(rt.redis, "cpu", "node-1-42", {})
    after_death.sweep()
    rt.redis.delete("rq:worker:cpu:node-1-42")
    for _ in range(AFTER_DEATH_SWEEPS):
        after_death.sweep()
    late = new_job(rt)  # lost after the last sweep: the stall sweep's, not these
    assert after_death.sweep() == [] and after_death.sweep() == []
    assert queued(rt, PREPROCESS_QUEUE) == []
    # The next death looks again.
    beat(rt.redis, "gpu", "node-2-7", {})
    after_death.sweep()
    rt.redis.delete("rq:worker:gpu:node-2-7")
    assert after_death.sweep() == [] and after_death.sweep() == [late]
