"""A job's event stream against a real Redis: the status events the job store writes in its own
moves, attempts and restarts, token entries in one pipeline, reading after a position, and the
ledger that keeps a dialect stream's tokens single across a redo."""

from __future__ import annotations

import pytest

from domain.jobs.event_hub import EventHub
from domain.jobs.events import Attempt, JobEvent
from domain.jobs.follow import Ended, KeepAlive, StreamDivergedError, TokenLedger, follow
from engine.choice import Choice
from workers.gpu.jobs import poll_running

OWNER = "key_owner"


@pytest.fixture
def hub(events):
    hub = EventHub(events)
    yield hub
    hub.close()


def new_job(jobs):
    return jobs.create(owner=OWNER, kind="generate", request={"token_ids": [1]}, request_id=None)


def test_every_move_of_the_job_is_a_status_event_with_the_jobs_ttl(jobs, events, client):
    job = new_job(jobs)
    assert jobs.advance(job["id"], "preprocessing", owner=OWNER)
    assert not jobs.advance(job["id"], "queued", owner=OWNER)  # no move, no event
    assert jobs.advance(job["id"], "generating", owner=OWNER)
    assert jobs.advance(job["id"], "succeeded", owner=OWNER, result={"choices": []})
    assert [(e.type, e.data) for e in events.all(job["id"])] == [
        ("status", {"status": s}) for s in ("queued", "preprocessing", "generating", "succeeded")]
    assert 0 < client.ttl(f"rq:job:{job['id']}:events") <= 600


def test_a_redo_is_a_new_attempt_with_a_restart_event(jobs, events):
    job = new_job(jobs)
    assert events.begin_attempts([job["id"]]) == [Attempt(1, watched=False)]
    assert events.begin_attempts([job["id"]]) == [Attempt(2, watched=False)]
    assert [e.type for e in events.all(job["id"])] == ["status", "restart"]
    assert events.all(job["id"])[-1].data == {"attempt": 2}


def test_a_job_followed_by_a_reader_is_marked_watched_for_its_events_lifetime(jobs, events, hub, client):
    read, unread = new_job(jobs), new_job(jobs)
    jobs.advance(read["id"], "succeeded", owner=OWNER, result={"choices": []})
    assert [item for item in follow(hub, jobs, {read["id"]: "0"}, keepalive=0.05)][-1][1].job["id"] == read["id"]
    assert poll_running(client, [], [read["id"], unread["id"]]) == (set(), {read["id"]})
    # An ended job begins no attempt; a running one learns it is read as its attempt begins.
    assert events.begin_attempts([read["id"], unread["id"]]) == [None, Attempt(1, watched=False)]
    running = new_job(jobs)
    events.watch([running["id"]])
    assert events.begin_attempts([running["id"]]) == [Attempt(1, watched=True)]
    assert 0 < client.ttl(f"rq:job:{read['id']}:watched") <= 600


def test_tokens_of_many_jobs_and_reading_after_a_position(jobs, events):
    a, b = new_job(jobs), new_job(jobs)
    events.publish_tokens([(a["id"], 1, [{"index": 0, "offset": 0, "token_ids": [5], "finish_reason": None}]),
                           (b["id"], 1, [{"index": 0, "offset": 0, "token_ids": [7], "finish_reason": None}])])
    read = events.read({a["id"]: "0", b["id"]: "0"}, block_ms=None)
    assert sorted((job_id, e.type) for job_id, e in read) == sorted(
        [(a["id"], "status"), (a["id"], "tokens"), (b["id"], "status"), (b["id"], "tokens")])
    first = events.all(a["id"])[0]
    [(job_id, event)] = events.read({a["id"]: first.id}, block_ms=None)
    assert job_id == a["id"] and event.data["choices"][0]["token_ids"] == [5]


def test_follow_ends_each_job_with_its_record_and_keeps_alive_while_idle(jobs, hub):
    job = new_job(jobs)
    jobs.advance(job["id"], "generating", owner=OWNER)
    seen = []
    for item in follow(hub, jobs, {job["id"]: "0"}, keepalive=0.05):
        seen.append(item)
        if isinstance(item, KeepAlive) and len(seen) < 5:
            jobs.advance(job["id"], "succeeded", owner=OWNER, result={"choices": []})
    kinds = [type(item[1]).__name__ if isinstance(item, tuple) else "KeepAlive" for item in seen]
    assert kinds == ["JobEvent", "JobEvent", "KeepAlive", "JobEvent", "Ended"], kinds
    assert isinstance(seen[-1][1], Ended) and seen[-1][1].job["status"] == "succeeded"


def tokens_event(jobs, events, job_id, attempt, offset, ids):
    events.publish_tokens([(job_id, attempt, [{"index": 0, "offset": offset, "token_ids": ids, "finish_reason": None}])])
    return events.all(job_id)[-1]


def test_the_ledger_skips_a_redo_where_it_equals_what_was_sent_and_refuses_where_it_differs(jobs, events):
    job = new_job(jobs)["id"]
    ledger = TokenLedger()
    assert [d.token_ids for d in ledger.take(job, tokens_event(jobs, events, job, 1, 0, [1, 2, 3]))] == [[1, 2, 3]]
    events.begin_attempts([job])
    events.begin_attempts([job])
    ledger.take(job, events.all(job)[-1])  # restart, attempt 2
    assert [d.token_ids for d in ledger.take(job, tokens_event(jobs, events, job, 2, 0, [1, 2]))] == [[]]
    assert [d.token_ids for d in ledger.take(job, tokens_event(jobs, events, job, 2, 2, [3, 4]))] == [[4]]
    # A straggler of the dead attempt is dropped, whatever it says (the stream refuses to write one:
    # tests/domain/jobs/test_attempts.py; a reader still holds to this rule).
    straggler = JobEvent("1-1", "tokens", {"attempt": 1, "choices": [{"index": 0, "offset": 3, "token_ids": [9],
                                                                       "finish_reason": None}]})
    assert ledger.take(job, straggler) == []
    with pytest.raises(StreamDivergedError):
        ledger.take(job, tokens_event(jobs, events, job, 2, 1, [8]))
    assert [d.token_ids for d in ledger.finish(job, [Choice(0, [1, 2, 3, 4, 5], None, "length", text="")])] == [[5]]
