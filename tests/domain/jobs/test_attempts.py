"""Fenced attempts against a real Redis (domain/jobs/attempts.py): a superseded run writes no
tokens, no end, no prompt; a job another live worker runs begins no attempt elsewhere; a hold is
given up before the job goes back to the queue; the session's poll sees an attempt superseded."""

from __future__ import annotations

from domain.infra.heartbeats import beat, heartbeat_key
from domain.jobs.attempts import FENCED, Fence, holder_key
from domain.jobs.events import Attempt
from workers.gpu.jobs import poll_session

OWNER = "key_owner"
A, B = heartbeat_key("gpu", "node-a-1"), heartbeat_key("gpu", "node-b-2")


def new_job(jobs, **extra):
    return jobs.create(owner=OWNER, kind="generate", request={"token_ids": [1]}, request_id=None, extra=extra or None)


def tokens(offset, ids):
    return [{"index": 0, "offset": offset, "token_ids": ids, "finish_reason": None}]


def test_a_superseded_attempt_writes_no_tokens(jobs, events):
    job = new_job(jobs)["id"]
    assert events.begin_attempts([job], holder=A) == [Attempt(1, watched=False)]
    assert events.publish_tokens([(job, 1, tokens(0, [1, 2]))]) == set()
    assert events.begin_attempts([job], holder=B) == [Attempt(2, watched=False)]  # A's heartbeat lapsed
    assert events.publish_tokens([(job, 1, tokens(2, [3])), (job, 2, tokens(0, [7]))]) == {job}
    written = [(e.type, e.data.get("attempt")) for e in events.all(job)]
    assert written == [("status", None), ("tokens", 1), ("restart", 2), ("tokens", 2)]


def test_only_the_newest_attempt_ends_the_job(jobs, events, client):
    job = new_job(jobs)["id"]
    jobs.advance(job, "generating", owner=OWNER)
    events.begin_attempts([job], holder=A)
    events.begin_attempts([job], holder=B)
    moves = [(job, OWNER, "succeeded", {"result": {"by": "a"}})]
    assert jobs.advance_fenced(moves, [Fence.generation(job, 1)]) == [FENCED]
    assert jobs.get(job)["status"] == "generating"
    assert client.llen(jobs.done_key(job)) == 0  # no waiter woken
    assert jobs.advance_fenced([(job, OWNER, "succeeded", {"result": {"by": "b"}})], [Fence.generation(job, 2)]) == [1]
    assert jobs.get(job)["result"] == {"by": "b"}


def test_a_job_another_live_worker_runs_begins_no_attempt_elsewhere(jobs, events, client):
    job = new_job(jobs)["id"]
    assert events.begin_attempts([job], holder=A) == [Attempt(1, watched=False)]
    beat(client, "gpu", "node-a-1", {"running": ["job_other", job]})
    # A seemed dead and its message was handed back, but A is alive and runs the job: B's copy is a duplicate.
    assert events.begin_attempts([job], holder=B) == [None]
    assert [e.type for e in events.all(job)] == ["status"]  # no restart, no number taken
    assert client.get(holder_key(job)) == A.encode()
    # The holder itself redoes it (its own message came back to it): a new attempt.
    assert events.begin_attempts([job], holder=A) == [Attempt(2, watched=False)]
    # A alive but no longer running it (its session gave the message back): B may.
    beat(client, "gpu", "node-a-1", {"running": []})
    assert events.begin_attempts([job], holder=B) == [Attempt(3, watched=False)]
    # B's heartbeat gone (dead): A may again.
    assert events.begin_attempts([job], holder=A) == [Attempt(4, watched=False)]


def test_an_ended_job_begins_no_attempt(jobs, events):
    job = new_job(jobs)["id"]
    jobs.advance(job, "cancelled", owner=OWNER)
    assert events.begin_attempts([job], holder=A) == [None]


def test_a_hold_is_given_up_before_its_job_goes_back_to_the_queue(jobs, events, client):
    job = new_job(jobs)["id"]
    events.begin_attempts([job], holder=A)
    beat(client, "gpu", "node-a-1", {"running": [job]})  # A's last beat still lists it
    assert events.release_attempts([(job, 1)]) == [True]
    assert client.get(holder_key(job)) is None
    assert events.begin_attempts([job], holder=B) == [Attempt(2, watched=False)]
    assert events.release_attempts([(job, 1)]) == [False]  # superseded: it must not send the job again
    assert client.get(holder_key(job)) == B.encode()


def test_the_sessions_poll_finds_its_superseded_attempts(jobs, events, client):
    kept, taken = new_job(jobs)["id"], new_job(jobs)["id"]
    events.begin_attempts([kept, taken], holder=A)
    events.begin_attempts([taken], holder=B)
    client.set(jobs.cancel_key(kept), 1)
    polled = poll_session(client, {kept: 1, taken: 1}, [kept, taken], [kept])
    assert (polled.cancelled, polled.watched, polled.superseded) == ({kept}, set(), {taken})


def test_only_the_newest_preprocessing_run_saves_the_prompt_or_fails_the_job(jobs):
    from engine.errors import InvalidRequestError

    job = new_job(jobs)["id"]
    jobs.advance(job, "preprocessing", owner=OWNER)
    late = jobs.claim_preprocessing(job)  # a CPU worker paused mid-fetch
    newest = jobs.claim_preprocessing(job)  # the run its message got on another worker
    assert (late.number, newest.number) == (1, 2)
    assert not jobs.save_prompt_fenced(job, '{"by": "late"}', late)
    assert not jobs.fail(job, InvalidRequestError("fetch deadline passed while paused"), fence=late)
    assert jobs.prompts([job]) == [None] and jobs.get(job)["status"] == "preprocessing"
    assert jobs.save_prompt_fenced(job, '{"by": "newest"}', newest)
    jobs.advance(job, "generating", owner=OWNER)
    # Generating from that prompt: a second save of the same run is refused, unless its handles are made again.
    assert not jobs.save_prompt_fenced(job, '{"by": "again"}', newest)
    assert jobs.save_prompt_fenced(job, '{"by": "handles"}', newest, generating_ok=True)
    assert jobs.prompts([job]) == [b'{"by": "handles"}']
    jobs.advance(job, "cancelled", owner=OWNER)
    assert not jobs.save_prompt_fenced(job, '{"by": "ended"}', newest, generating_ok=True)
