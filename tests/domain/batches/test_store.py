"""Batches on the worker side, against a real Redis and a real Celery broker (no worker consumes:
the tests run the task bodies themselves and end jobs through the job store and lifecycle)."""

from __future__ import annotations

import json
import time

import pytest
import redis

from domain.batches.creation import ParsedBatch, create_batch
from domain.batches.keys import lines_key, output_key
from domain.batches.progress import record_job_lines
from domain.batches.store import PAGE
from domain.batches.sweeps import cancel_lines, expire
from domain.jobs.store import QueueFullError
from domain.lifecycle import end_job, end_jobs, fail_job
from domain.names import BATCHES_QUEUE, PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE
from domain.settings import Settings
from engine.errors import ContextLengthError
from tests.conftest import db_url
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.runtime import Runtime
from workers.tasks.batches import submit_chunk

OWNER = "key_owner"
RESULT = {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": [5], "finish_reason": "length"}]}


@pytest.fixture
def batch_redis_url(redis_url) -> str:
    return db_url(redis_url, 3)


@pytest.fixture
def redis_client(batch_redis_url):
    client = redis.Redis.from_url(batch_redis_url)
    yield client
    client.close()


@pytest.fixture
def make_rt(batch_redis_url, redis_client, tmp_path):
    def make(**overrides) -> Runtime:
        redis_client.flushdb()
        settings = Settings(state_dir=tmp_path, batch_chunk_size=4, **overrides)
        return Runtime(settings, batch_redis_url, create_celery(settings, batch_redis_url))

    return make


@pytest.fixture
def rt(make_rt):
    return make_rt()


def new_batch(rt, valid: int, invalid: int = 0, *, window: int = 3600, webhook=None) -> dict:
    parsed = ParsedBatch(total=valid + invalid)
    for n in range(1, valid + 1):
        request = stored_request(token_ids=[1, 2, n], sampling_params={"max_tokens": 2})  # as the API stores lines
        parsed.valid.append(json.dumps({"line": n, "custom_id": f"c{n}", "request": request}))
    for n in range(valid + 1, valid + invalid + 1):
        parsed.invalid.append({"custom_id": f"c{n}", "line": n, "error": {"code": "invalid_json", "message": "x"}})
    return create_batch(rt, OWNER, parsed, completion_window=window, metadata={"run": "t"}, webhook=webhook)


def submit_all(rt, batch_id: str) -> list[dict]:
    chunks = rt.batches.get(batch_id)["chunks"]
    for index in range(chunks):
        submit_chunk(rt, batch_id, index)
    job_ids = rt.batches.line_jobs(batch_id, list(range(1, 1000)))
    return [rt.jobs.get(job_ids[n]) for n in sorted(job_ids)]


def counts(rt, batch_id: str) -> tuple[str, int, int, int]:
    batch = rt.batches.get(batch_id)
    return batch["status"], batch["total"], batch["completed"], batch["failed"]


def results(rt, batch_id: str, which: str) -> list[dict]:
    return [json.loads(item) for page in rt.batches.iter_results(batch_id, which) for item in page]


def test_create_stores_lines_and_queues_one_message_per_chunk(rt, redis_client):
    batch = new_batch(rt, 10)
    assert batch["status"] == "in_progress" and batch["object"] == "batch"
    assert batch["request_counts"] == {"total": 10, "completed": 0, "failed": 0}
    assert batch["in_progress_at"] >= batch["created_at"] and batch["metadata"] == {"run": "t"}
    assert batch["expires_at"] == pytest.approx(batch["created_at"] + 3600)
    assert redis_client.llen(lines_key(batch["id"])) == 10
    stored = rt.batches.get(batch["id"])
    assert stored["chunks"] == 3 and stored["chunk_size"] == 4
    # 3 chunk messages + the expiry check; no job exists yet.
    assert redis_client.llen(BATCHES_QUEUE) == 4
    assert redis_client.llen(PREPROCESS_QUEUE) == 0


def test_chunk_creates_jobs_with_their_line_and_is_idempotent(rt, redis_client):
    batch = new_batch(rt, 10)
    assert submit_chunk(rt, batch["id"], 1) == 4
    assert submit_chunk(rt, batch["id"], 1) == 0  # a redelivered message creates nothing twice
    assert submit_chunk(rt, batch["id"], 2) == 2
    jobs = [rt.jobs.get(job_id) for job_id in rt.batches.line_jobs(batch["id"], list(range(1, 11))).values()]
    assert sorted(int(job["line"]) for job in jobs) == [5, 6, 7, 8, 9, 10]
    job = next(job for job in jobs if job["line"] == "5")
    assert job["batch_id"] == batch["id"] and job["custom_id"] == "c5" and job["owner"] == OWNER
    assert job["request"]["token_ids"] == [1, 2, 5] and job["status"] == "queued"
    # Made in one round trip, but one message each (a GPU worker reserves messages, not jobs): plain
    # token prompts straight to the GPU queue, the others to preprocessing.
    assert redis_client.llen(PREPROCESS_QUEUE) + redis_client.llen(SHARED_GENERATE_QUEUE) == 6


def test_jobs_ended_together_count_their_lines_in_one_record(rt):
    """A GPU batch ends its jobs with ``end_jobs``: jobs of two batches, one record per batch."""
    first, second = new_batch(rt, 3), new_batch(rt, 2)
    jobs = submit_all(rt, first["id"]) + submit_all(rt, second["id"])
    endings = [(rt.jobs.get(job["id"]), "succeeded", {"result": RESULT}) for job in jobs[:4]]
    assert end_jobs(rt, endings) == [True] * 4
    assert end_jobs(rt, endings[:1]) == [False]  # ended already: not counted again
    assert counts(rt, first["id"])[0] == "completed"
    assert counts(rt, second["id"]) == ("in_progress", 2, 1, 0)
    assert sorted(line["custom_id"] for line in results(rt, first["id"], "output")) == ["c1", "c2", "c3"]


def test_lines_count_once_and_the_last_one_completes_the_batch(rt, redis_client):
    batch = new_batch(rt, 5, invalid=2)
    assert batch["request_counts"] == {"total": 7, "completed": 0, "failed": 2}
    jobs = submit_all(rt, batch["id"])
    assert len(jobs) == 5
    for job in jobs[:3]:
        assert end_job(rt, job["id"], "succeeded", result=RESULT)
    assert fail_job(rt, jobs[3]["id"], ContextLengthError("too long"))
    # A second report of an ended job (a redelivered task) changes nothing.
    record_job_lines(rt, [rt.jobs.get(jobs[0]["id"])])
    assert counts(rt, batch["id"]) == ("in_progress", 7, 3, 3)
    assert end_job(rt, jobs[4]["id"], "succeeded", result=RESULT)
    ended = rt.batches.get(batch["id"])
    assert (ended["status"], ended["completed"], ended["failed"]) == ("completed", 4, 3)
    assert ended["in_progress_at"] <= ended["finalizing_at"] <= ended["completed_at"]
    assert not redis_client.exists(lines_key(batch["id"]))
    assert 0 < redis_client.ttl(output_key(batch["id"])) <= rt.settings.result_ttl
    output = results(rt, batch["id"], "output")
    assert sorted(line["custom_id"] for line in output) == ["c1", "c2", "c3", "c5"]
    first = next(line for line in output if line["custom_id"] == "c1")
    assert first == {"custom_id": "c1", "line": 1, "job_id": jobs[0]["id"],
                     "response": {"status_code": 200, "body": RESULT}}
    errors = {line["line"]: line for line in results(rt, batch["id"], "errors")}
    assert sorted(errors) == [4, 6, 7]
    assert errors[4]["error"]["code"] == "context_length_exceeded" and errors[4]["job_id"] == jobs[3]["id"]
    assert errors[6]["error"]["code"] == "invalid_json"


def test_a_record_of_thousands_of_lines_counts_each_once_and_settles_once(rt):
    """A sweep (or a file's invalid lines) may count thousands of lines in one call: the store pages
    them (the script pushes a call's lines in one command, and Lua unpacks at most 8,000 values),
    and the call that counts the last line settles the batch."""
    lines = 9 * PAGE + 500
    batch_id = new_batch(rt, 1, invalid=lines - 1)["id"]  # its invalid lines are counted as it is made
    entry = {"custom_id": "c1", "line": 1, "response": {"status_code": 200, "body": RESULT}}
    again = [(n, False, {"line": n, "error": {"code": "x", "message": "again"}}) for n in range(2, lines + 1)]
    assert not rt.batches.record(batch_id, again)  # all counted before: nothing changes
    assert rt.batches.record(batch_id, again + [(1, True, entry)])
    assert counts(rt, batch_id)[1:] == (lines, 1, lines - 1)
    assert len(results(rt, batch_id, "errors")) == lines - 1
    assert all(line["error"]["code"] == "invalid_json" for line in results(rt, batch_id, "errors"))


def test_cancel_keeps_finished_lines_and_waits_for_running_ones(rt, redis_client):
    batch = new_batch(rt, 10)
    submit_chunk(rt, batch["id"], 0)  # lines 1-4 get jobs; 5-10 never will
    jobs = [rt.jobs.get(job_id) for job_id in rt.batches.line_jobs(batch["id"], [1, 2, 3, 4]).values()]
    jobs.sort(key=lambda job: int(job["line"]))
    end_job(rt, jobs[0]["id"], "succeeded", result=RESULT)
    rt.jobs.advance(jobs[1]["id"], "preprocessing")
    rt.jobs.advance(jobs[1]["id"], "generating")
    assert rt.batches.move(batch["id"], "cancelling", from_=("in_progress",))

    cancel_lines(rt, batch["id"])
    assert submit_chunk(rt, batch["id"], 1) == 0  # chunks that arrive later make no jobs
    assert rt.jobs.get(jobs[2]["id"])["status"] == "cancelled"
    assert redis_client.exists(rt.jobs.cancel_key(jobs[1]["id"]))  # generating: asked to abort
    assert counts(rt, batch["id"]) == ("cancelling", 10, 1, 8)

    end_job(rt, jobs[1]["id"], "cancelled", result=RESULT)  # the GPU worker aborts it
    ended = rt.batches.get(batch["id"])
    assert (ended["status"], ended["completed"], ended["failed"]) == ("cancelled", 1, 9)
    assert ended["cancelling_at"] <= ended["cancelled_at"]
    assert [line["custom_id"] for line in results(rt, batch["id"], "output")] == ["c1"]
    codes = {line["line"]: line["error"]["code"] for line in results(rt, batch["id"], "errors")}
    assert codes == {n: "batch_cancelled" for n in range(2, 11)}


def test_expiry_turns_unfinished_lines_into_errors(rt, redis_client):
    batch = new_batch(rt, 6, window=1)
    jobs = submit_all(rt, batch["id"])
    end_job(rt, jobs[0]["id"], "succeeded", result=RESULT)
    rt.jobs.advance(jobs[1]["id"], "preprocessing")
    rt.jobs.advance(jobs[1]["id"], "generating")
    remaining = expire(rt, batch["id"])
    assert remaining is not None and 0 < remaining <= 1  # not due yet: check again later
    time.sleep(remaining + 0.05)
    assert expire(rt, batch["id"]) is None
    ended = rt.batches.get(batch["id"])
    assert (ended["status"], ended["completed"], ended["failed"]) == ("expired", 1, 5)
    assert ended["expired_at"] >= ended["expires_at"]
    codes = {line["line"]: line["error"]["code"] for line in results(rt, batch["id"], "errors")}
    assert codes == {n: "batch_expired" for n in range(2, 7)}
    assert rt.jobs.get(jobs[2]["id"])["status"] == "cancelled"
    assert redis_client.exists(rt.jobs.cancel_key(jobs[1]["id"]))
    # The running job ends later: its line is already counted.
    end_job(rt, jobs[1]["id"], "succeeded", result=RESULT)
    assert counts(rt, batch["id"]) == ("expired", 6, 1, 5)
    assert expire(rt, batch["id"]) is None


def test_full_queue_pauses_a_chunk_without_failing_lines(make_rt):
    rt = make_rt(max_queued_per_key=3)
    batch = new_batch(rt, 4)
    with pytest.raises(QueueFullError) as full:
        submit_chunk(rt, batch["id"], 0)
    assert full.value.headers["Retry-After"]
    jobs = [rt.jobs.get(job_id) for job_id in rt.batches.line_jobs(batch["id"], [1, 2, 3, 4]).values()]
    assert len(jobs) == 3
    assert counts(rt, batch["id"]) == ("in_progress", 4, 0, 0)
    end_job(rt, jobs[0]["id"], "succeeded", result=RESULT)
    assert submit_chunk(rt, batch["id"], 0) == 1  # the retry carries on where it stopped
    assert len(rt.batches.line_jobs(batch["id"], [1, 2, 3, 4])) == 4


def test_the_end_of_a_batch_makes_one_webhook_event(rt):
    batch = new_batch(rt, 2, webhook={"url": "https://hooks.example.com/rq", "events": ["batch.completed"]})
    for job in submit_all(rt, batch["id"]):
        end_job(rt, job["id"], "succeeded", result=RESULT)
    record_job_lines(rt, [rt.jobs.get(job["id"])])
    events = rt.webhooks.deliveries("batch", batch["id"])
    assert [(event["type"], event["url"]) for event in events] == [("batch.completed", "https://hooks.example.com/rq")]
    payload = json.loads(rt.webhooks.get(events[0]["id"])["payload"])
    assert payload["data"]["id"] == batch["id"]
    assert payload["data"]["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


def test_listing_is_newest_first_with_a_cursor(rt):
    made = [new_batch(rt, 1)["id"] for _ in range(3)]
    store = rt.batches
    first, cursor = store.list(owner=OWNER, status=None, limit=2, cursor=None)
    rest, end = store.list(owner=OWNER, status=None, limit=2, cursor=cursor)
    assert [b["id"] for b in first + rest] == made[::-1] and end is None
    assert store.list(owner="key_other", status=None, limit=5, cursor=None) == ([], None)


def test_lines_the_service_cannot_run_end_the_batch_failed(rt, redis_client, caplog):
    batch = new_batch(rt, 2)
    # A stored line that is not a request (as if corrupted in Redis): the chunk cannot make its job.
    redis_client.lset(lines_key(batch["id"]), 1, json.dumps({"line": 2, "custom_id": "c2", "request": "?"}))
    assert submit_chunk(rt, batch["id"], 0) == 1
    assert "could not create jobs" in caplog.text
    assert counts(rt, batch["id"]) == ("in_progress", 2, 0, 1)
    (job,) = [rt.jobs.get(job_id) for job_id in rt.batches.line_jobs(batch["id"], [1, 2]).values()]
    end_job(rt, job["id"], "succeeded", result=RESULT)
    ended = rt.batches.get(batch["id"])
    assert (ended["status"], ended["completed"], ended["failed"]) == ("failed", 1, 1)
    assert ended["failed_at"] >= ended["finalizing_at"]
    assert [line["error"]["code"] for line in results(rt, batch["id"], "errors")] == ["internal_error"]


def test_owner_and_webhook_read_without_the_whole_record(rt):
    hook = {"url": "https://hooks.example.com/batches", "events": ["batch.completed"]}
    with_hook, without = new_batch(rt, 1, webhook=hook), new_batch(rt, 1)
    store = rt.batches
    assert store.owner_and_webhook(with_hook["id"]) == (OWNER, hook)
    assert store.owner_and_webhook(without["id"]) == (OWNER, None)
    assert store.owner_and_webhook("batch_gone") == (None, None)


def test_a_line_debt_stays_while_the_primary_does_not_hold_the_line_counted(rt, redis_client):
    """A split brain: a job's line was recorded on an old primary that still took writes, the debt
    dropped on the new one. Dropped only where the line is counted (or its batch is gone), the debt
    stays for the batch reaper."""
    batch = new_batch(rt, 2)
    first, second = submit_all(rt, batch["id"])
    for job in (first, second):
        rt.jobs.advance(job["id"], "succeeded", owner=OWNER, result=RESULT)  # ended; lines owed
    owed = [(job["id"], batch["id"], int(job["line"])) for job in (first, second)]
    assert rt.batches.settle_line_debts(owed) == 0  # neither line is counted here
    assert set(rt.jobs.uncounted_lines(before=time.time() + 1, limit=10)) == {first["id"], second["id"]}
    record_job_lines(rt, [rt.jobs.get(first["id"])])  # counts the first line, then drops its debt
    assert rt.jobs.uncounted_lines(before=time.time() + 1, limit=10) == [second["id"]]
    redis_client.delete(f"rq:batch:{batch['id']}")  # the batch is gone: nothing left to count into
    assert rt.batches.settle_line_debts(owed[1:]) == 1 and rt.jobs.uncounted_lines(before=time.time() + 1, limit=10) == []


def test_a_scoring_debt_stays_while_a_direct_line_of_its_chunk_is_not_counted(rt):
    batch = new_batch(rt, 4)
    expire_at = rt.batches.get(batch["id"])["keys_expire_at"]
    rt.batches.owe_scoring(batch["id"], 0, expire_at=expire_at)
    assert not rt.batches.scoring_done(batch["id"], 0, [1, 2])
    rt.batches.record(batch["id"], [(1, True, {"line": 1}), (2, False, {"line": 2})])
    assert rt.batches.scoring_done(batch["id"], 0, [1, 2])
    assert rt.batches.chunk_progress(batch["id"])[1] == set()


def test_a_chunk_is_marked_submitted_only_where_its_jobs_are(rt, redis_client):
    """A split brain: a chunk's jobs were written to an old primary that still took writes, their
    mapping and the chunk's mark to the new one. The mark is refused while a mapped job is missing,
    so the batch reaper sends the chunk again, and its run makes the missing job anew."""
    batch = new_batch(rt, 3)
    submit_chunk(rt, batch["id"], 0)
    assert rt.batches.chunk_progress(batch["id"])[0] == {0}
    mapped = rt.batches.line_jobs(batch["id"], [1, 2, 3])
    redis_client.srem(f"rq:batch:{batch['id']}:submitted", 0)
    redis_client.delete(rt.jobs.key(mapped[2]))  # line 2's job went where the resync dropped it
    expire_at = rt.batches.get(batch["id"])["keys_expire_at"]
    assert not rt.batches.chunks_submitted(batch["id"], 0, mapped, expire_at=expire_at)
    assert not rt.batches.chunks_submitted(batch["id"], 0, {1: mapped[1], 3: None}, expire_at=expire_at)  # 3 uncounted
    assert rt.batches.chunk_progress(batch["id"])[0] == set()

    assert submit_chunk(rt, batch["id"], 0) == 1  # the reaper's resend: only line 2 is made again
    again = rt.batches.line_jobs(batch["id"], [1, 2, 3])
    assert again[1] == mapped[1] and again[3] == mapped[3] and again[2] != mapped[2]
    assert rt.jobs.get(again[2])["line"] == "2"
    assert rt.batches.chunk_progress(batch["id"])[0] == {0}
