"""The sweep that sends again a batch's chunk, scoring and expiry messages a crash lost
(domain.batches.reaper), against a real Redis and broker. No worker consumes: a lost message is one
deleted from its queue, and a held one is taken the way a worker takes it (basic_get, no ack)."""

from __future__ import annotations

import base64
import json

import pytest

from domain.batches.creation import ParsedBatch, create_batch
from domain.batches.keys import OPEN_KEY
from domain.batches.messages import send_chunk
from domain.batches.reaper import BatchReaper
from domain.batches.store import DIRECT_LINE, BatchStore
from domain.batches.sweeps import expire
from domain.names import (
    BATCHES_QUEUE,
    DELIVER_TASK,
    ENQUEUE_CHUNK_TASK,
    EXPIRE_BATCH_TASK,
    SCORE_LINES_TASK,
    SHARED_GENERATE_QUEUE,
    WEBHOOKS_QUEUE,
)
from domain.settings import Settings
from tests.conftest import empty_db_url
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.runtime import runtime
from workers.tasks.batches import submit_chunk

OWNER = "key_owner"


@pytest.fixture
def rt(redis_url, tmp_path):
    settings = Settings(state_dir=tmp_path, batch_chunk_size=2)
    return runtime(create_celery(settings, empty_db_url(redis_url, 29)))


@pytest.fixture
def reaper(rt):
    # stall_s=0: every open batch is a candidate at once; only the carriers decide.
    return BatchReaper(rt, stall_s=0)


def new_batch(rt, lines: int, *, window: int = 3600) -> str:
    """A batch of ``lines`` plain-text lines (chunks of 2) whose messages were all lost."""
    parsed = ParsedBatch(total=lines)
    for n in range(1, lines + 1):
        request = stored_request(token_ids=[1, 2, n], sampling_params={"max_tokens": 2})
        parsed.valid.append(json.dumps({"line": n, "custom_id": f"c{n}", "request": request}))
    batch = create_batch(rt, OWNER, parsed, completion_window=window, metadata=None, webhook=None)
    rt.redis.delete(BATCHES_QUEUE)
    return batch["id"]


def queued(rt, queue: str) -> list[tuple]:
    """(task, *args) of each message waiting in ``queue``, oldest first."""
    found = []
    for raw in reversed(rt.redis.lrange(queue, 0, -1)):  # kombu LPUSHes
        message = json.loads(raw)
        args, _, _ = json.loads(base64.b64decode(message["body"]))
        found.append((message["headers"]["task"], *args))
    return found


def test_chunks_no_message_carries_are_sent_again_on_the_second_sweep_that_misses_them(rt, reaper):
    batch_id = new_batch(rt, 5)
    assert reaper.sweep() == []  # missed once: a message may be between a pop and its record
    assert queued(rt, BATCHES_QUEUE) == []
    again = [(ENQUEUE_CHUNK_TASK, batch_id, index) for index in range(3)]
    assert sorted(reaper.sweep()) == again
    assert sorted(queued(rt, BATCHES_QUEUE)) == again
    assert reaper.sweep() == [] and reaper.sweep() == []  # carried now
    assert len(queued(rt, BATCHES_QUEUE)) == 3


def test_chunks_submitted_or_carried_are_left_alone(rt, reaper):
    batch_id = new_batch(rt, 5)
    submit_chunk(rt, batch_id, 0)  # made its jobs: submitted
    send_chunk(rt.celery, batch_id, 1)  # waiting in the queue
    send_chunk(rt.celery, batch_id, 2)
    with rt.celery.connection_for_read() as connection:
        held = connection.channel().basic_get(BATCHES_QUEUE, no_ack=False)  # a worker holds chunk 1
        assert held is not None and queued(rt, BATCHES_QUEUE) == [(ENQUEUE_CHUNK_TASK, batch_id, 2)]
        assert reaper.sweep() == [] and reaper.sweep() == []
        assert queued(rt, BATCHES_QUEUE) == [(ENQUEUE_CHUNK_TASK, batch_id, 2)]


def test_a_scoring_run_no_message_carries_is_sent_again(rt, reaper):
    batch_id = new_batch(rt, 4)
    expire_at = rt.batches.get(batch_id)["keys_expire_at"]
    for index, lines in enumerate(([1, 2], [3, 4])):  # both chunks scored directly
        rt.batches.set_line_jobs(batch_id, dict.fromkeys(lines, DIRECT_LINE), expire_at=expire_at)
        assert rt.batches.chunks_submitted(batch_id, index, dict.fromkeys(lines, DIRECT_LINE), expire_at=expire_at)
    rt.batches.owe_scoring(batch_id, 1, expire_at=rt.batches.get(batch_id)["keys_expire_at"])
    assert reaper.sweep() == []
    assert reaper.sweep() == [(SCORE_LINES_TASK, batch_id, 1)]
    assert queued(rt, SHARED_GENERATE_QUEUE) == [(SCORE_LINES_TASK, batch_id, 1)]
    assert reaper.sweep() == []
    assert rt.batches.scoring_done(batch_id, 1, [])
    rt.redis.delete(SHARED_GENERATE_QUEUE)
    assert reaper.sweep() == [] and reaper.sweep() == []  # nothing owed any more


def test_a_batch_past_its_window_gets_its_expiry_check_again_and_leaves_the_index_when_it_ends(rt, reaper):
    batch_id = new_batch(rt, 3, window=0)
    assert reaper.sweep() == [(EXPIRE_BATCH_TASK, batch_id, -1)]  # no search: a duplicate is a no-op
    assert queued(rt, BATCHES_QUEUE) == [(EXPIRE_BATCH_TASK, batch_id)]
    expire(rt, batch_id)  # what the check does
    assert rt.batches.get(batch_id)["status"] == "expired"
    assert rt.redis.zscore(OPEN_KEY, batch_id) is None
    assert reaper.sweep() == []


def test_a_batch_is_looked_at_once_per_stall_period(rt):
    batch_id = new_batch(rt, 2)
    patient = BatchReaper(rt, stall_s=3600)
    assert patient.sweep() == [] and patient.sweep() == []  # created just now: not a candidate yet
    assert rt.redis.zscore(OPEN_KEY, batch_id) is not None


def test_an_ended_line_whose_count_was_lost_is_counted_once(rt, reaper):
    """A job of a batch ended, and its worker died (or a failover took the count) before its line
    was counted: the sweep counts it; a line counted since is left alone."""
    batch_id = new_batch(rt, 2)
    submit_chunk(rt, batch_id, 0)
    first, second = (rt.jobs.get(job_id) for job_id in rt.batches.line_jobs(batch_id, [1, 2]).values())
    for job in (first, second):  # the end's move alone, as a crash right after it leaves them
        assert rt.jobs.advance(job["id"], "succeeded", owner=OWNER, result={"choices": []})
    assert rt.batches.get(batch_id)["completed"] == 0
    assert reaper.count_lost_lines(before=0) == []  # ended just now: not looked at before the stall
    assert sorted(reaper.count_lost_lines(before=float("inf"))) == sorted([first["id"], second["id"]])
    assert rt.batches.get(batch_id)["completed"] == 2
    assert reaper.count_lost_lines(before=float("inf")) == []  # counted: the debts are settled


def test_a_batch_whose_last_line_was_counted_but_which_never_ended_is_ended(rt, reaper):
    """The worker that counted the last line died before it ended the batch."""
    batch_id = new_batch(rt, 2)
    submit_chunk(rt, batch_id, 0)
    entries = [(line, True, {"custom_id": f"c{line}", "line": line, "job_id": job_id,
                             "response": {"status_code": 200, "body": {}}})
               for line, job_id in rt.batches.line_jobs(batch_id, [1, 2]).items()]
    assert rt.batches.record(batch_id, entries)  # the call that counted the last line ...
    assert rt.batches.get(batch_id)["status"] == "in_progress"  # ... and died before ``finish``
    reaper.sweep()
    assert rt.batches.get(batch_id)["status"] == "completed"
    assert rt.redis.zscore(OPEN_KEY, batch_id) is None
    assert reaper.sweep() == []


def ended_batch(rt, *, webhook) -> str:
    """A cancelled batch: its move alone, as a worker that died before making its event leaves it."""
    parsed = ParsedBatch(total=1)
    parsed.valid.append(json.dumps({"line": 1, "custom_id": "c1", "request": stored_request(token_ids=[1, 2])}))
    batch_id = create_batch(rt, OWNER, parsed, completion_window=3600, metadata=None, webhook=webhook)["id"]
    assert rt.batches.move(batch_id, "cancelled", from_=("in_progress",))
    return batch_id


def test_a_batch_whose_end_made_no_webhook_event_gets_it_once(rt, reaper):
    hooked = ended_batch(rt, webhook={"url": "https://hooks.example.com/batches"})
    ended_batch(rt, webhook=None)  # owes nothing
    assert rt.webhooks.owed_batches(before=float("inf"), limit=10) == [hooked]  # the move recorded the debt
    assert reaper.emit_owed_events(before=0) == []  # not stalled yet
    assert reaper.emit_owed_events(before=float("inf")) == [hooked]
    (event_id,) = [args[0] for task, *args in queued(rt, WEBHOOKS_QUEUE) if task == DELIVER_TASK]
    event = rt.webhooks.get(event_id)
    assert (event["type"], event["object_id"]) == ("batch.cancelled", hooked)
    assert reaper.emit_owed_events(before=float("inf")) == []  # settled
    assert rt.webhooks.owed_batches(before=float("inf"), limit=10) == []


def test_a_batch_of_an_owner_with_a_key_wide_webhook_owes_an_event_at_its_end(rt):
    batch_id = new_batch(rt, 1)
    keywide = BatchStore(rt.redis, result_ttl=600, hooked_owners=frozenset({OWNER}))
    assert keywide.move(batch_id, "cancelling", from_=("in_progress",))
    assert rt.webhooks.owed_batches(before=float("inf"), limit=10) == []  # not an end
    assert keywide.move(batch_id, "cancelled", from_=("cancelling",))
    assert rt.webhooks.owed_batches(before=float("inf"), limit=10) == [batch_id]
