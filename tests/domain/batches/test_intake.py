"""A batch made while its file is read (domain.batches.creation.BatchIntake): its score lines are
scored before the file's end, nothing else runs before it, and a refused upload leaves nothing.

Real Redis and broker, the real engine on the demo model; no worker consumes: the tests run the
chunk and scoring task bodies themselves and read the messages off the queues."""

from __future__ import annotations

import json

import pytest

from domain.batches.creation import BatchIntake, BatchStorageFullError, BatchTooLargeError, ParsedBatch
from domain.batches.keys import OPEN_KEY, data_key, owner_input_key
from domain.batches.reaper import BatchReaper
from domain.batches.stored_input import StoredInput
from domain.lifecycle import end_jobs
from domain.names import (
    BATCHES_QUEUE,
    ENQUEUE_CHUNK_TASK,
    EXPIRE_BATCH_TASK,
    SCORE_LINES_TASK,
    SHARED_GENERATE_QUEUE,
)
from domain.settings import Settings
from tests.conftest import empty_db_url
from tests.domain.batches.test_reaper import queued
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.runtime import runtime
from workers.runtimes import GpuRuntime
from workers.tasks.batches import submit_chunk
from workers.tasks.score_lines import _score_chunk

OWNER = "key_owner"
RESULT = {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": [5], "finish_reason": "length"}]}


@pytest.fixture
def make_rt(redis_url, demo_model_dir, tmp_path):
    made = []

    def make(**overrides):
        settings = Settings(state_dir=tmp_path, model=str(demo_model_dir), batch_chunk_size=4,
                            fidelity_check=False, **overrides)
        app = create_celery(settings, empty_db_url(redis_url, 30))
        app.rollout_runtime_class = GpuRuntime  # the chunks' scoring runs as on a GPU worker
        made.append(rt := runtime(app))
        rt.load_model()  # as a GPU worker does before it takes work
        return rt

    yield make
    for rt in made:
        rt.weight_sync.stop()


@pytest.fixture
def rt(make_rt):
    return make_rt()


def block(*lines: tuple[int, str], invalid: tuple[int, ...] = ()) -> ParsedBatch:
    """Checked lines as the API hands them over: (line number, kind) for the valid ones."""
    parsed = ParsedBatch(total=len(lines) + len(invalid))
    for number, kind in lines:
        if kind == "score":
            request = stored_request(kind="score", token_ids=[100, 101, number], completion_token_ids=[110, 111])
        else:
            request = stored_request(token_ids=[1, 2, number], sampling_params={"max_tokens": 2})
        parsed.valid.append(json.dumps({"line": number, "custom_id": f"c{number}", "request": request}))
        parsed.scoring.append(kind == "score")
    parsed.invalid = [{"custom_id": f"c{n}", "line": n, "error": {"code": "invalid_json", "message": "x"}}
                      for n in invalid]
    return parsed


def open_intake(rt, total: int) -> BatchIntake:
    return BatchIntake(rt, OWNER, total=total, completion_window=3600, metadata=None, webhook=None)


def batch_keys(rt, batch_id: str) -> list[bytes]:
    return sorted(rt.redis.scan_iter(f"rq:batch:{batch_id}*"))


def test_score_lines_are_scored_while_the_file_is_read_and_the_rest_waits_for_its_end(rt):
    with open_intake(rt, total=7) as intake:
        batch_id = intake.batch_id
        intake.add(block(*((n, "score") for n in range(1, 5))))
        # The chunk of score lines is queued at once; the expiry check waits for the file's end.
        assert queued(rt, BATCHES_QUEUE) == [(ENQUEUE_CHUNK_TASK, batch_id, 0)]
        rt.redis.delete(BATCHES_QUEUE)
        assert submit_chunk(rt, batch_id, 0) == 0  # no job: its lines are scored directly
        assert queued(rt, SHARED_GENERATE_QUEUE) == [(SCORE_LINES_TASK, batch_id, 0)]
        assert _score_chunk(rt, batch_id, 0) == 4
        scored = rt.batches.get(batch_id)
        assert (scored["status"], scored["completed"]) == ("validating", 4)
        # Two generation lines (a chunk not yet full) and an invalid one: nothing is queued for them.
        intake.add(block((5, "generate"), (6, "generate"), invalid=(7,)))
        assert queued(rt, BATCHES_QUEUE) == []
        assert intake.close()["status"] == "in_progress"
    # The end queues the chunk not yet submitted, and the expiry check.
    assert sorted(queued(rt, BATCHES_QUEUE)) == [(ENQUEUE_CHUNK_TASK, batch_id, 1), (EXPIRE_BATCH_TASK, batch_id)]
    assert submit_chunk(rt, batch_id, 1) == 2
    jobs = [rt.jobs.get(job_id) for job_id in rt.batches.line_jobs(batch_id, [5, 6]).values()]
    assert end_jobs(rt, [(job, "succeeded", {"result": RESULT}) for job in jobs]) == [True, True]
    ended = rt.batches.get(batch_id)
    assert (ended["status"], ended["total"], ended["completed"], ended["failed"]) == ("completed", 7, 6, 1)
    assert ended["invalid_lines"] == 1 and [e["line"] for e in ended["validation_errors"]] == [7]


def test_a_chunk_of_generation_lines_does_not_run_before_the_file_ends(rt):
    """Even if its message came (a mixed chunk, or one sent again): its jobs wait for the end."""
    with open_intake(rt, total=4) as intake:
        intake.add(block((1, "score"), (2, "generate"), (3, "generate"), (4, "score")))
        assert submit_chunk(rt, intake.batch_id, 0) == 0
        assert _score_chunk(rt, intake.batch_id, 0) == 2
        assert rt.batches.line_jobs(intake.batch_id, [2, 3]) == {}
        assert rt.batches.chunk_progress(intake.batch_id)[0] == set()  # not submitted: the end sends it again
        intake.close()
    assert submit_chunk(rt, intake.batch_id, 0) == 2


def test_a_batch_whose_lines_all_ended_while_its_file_was_read_ends_when_it_closes(rt):
    with open_intake(rt, total=5) as intake:
        intake.add(block(*((n, "score") for n in range(1, 5)), invalid=(5,)))
        submit_chunk(rt, intake.batch_id, 0)
        _score_chunk(rt, intake.batch_id, 0)
        counted = rt.batches.get(intake.batch_id)
        assert (counted["status"], counted["completed"], counted["failed"]) == ("validating", 4, 1)
        assert intake.close()["status"] == "completed"


def stored_bytes(parsed: ParsedBatch) -> int:
    return sum(len(line) for line in parsed.valid)


@pytest.mark.parametrize("refusal", ["too_large", "storage_full", "no_valid_line"])
def test_a_refused_upload_leaves_nothing_of_what_it_scored(make_rt, refusal):
    first, second = block(*((n, "score") for n in range(1, 5))), block(*((n, "score") for n in range(5, 10)))
    size, other = stored_bytes(first) + stored_bytes(second), stored_bytes(first) // 2
    # too large: the file's lines alone pass the cap; storage full: with another upload's they do.
    rt = make_rt(batch_max_stored_bytes_per_key=size - 10 if refusal == "too_large" else size + 10)
    rt.redis.flushdb()
    if refusal == "storage_full":
        rt.redis.set(data_key("file_other"), b"x" * other, ex=60)  # an uploaded file holds some
        assert StoredInput(rt.redis).reserve(OWNER, "file_other", other, cap=size + 10, ttl=60) is None
    with pytest.raises((BatchTooLargeError, BatchStorageFullError, LookupError)), open_intake(rt, total=9) as intake:
        batch_id = intake.batch_id
        if refusal == "no_valid_line":
            intake.add(block(invalid=(1, 2)))
            raise LookupError("no valid line")  # what the API raises (a 422) when the file had none
        intake.add(first)
        submit_chunk(rt, batch_id, 0)
        assert _score_chunk(rt, batch_id, 0) == 4
        intake.add(second)
    assert batch_keys(rt, batch_id) == []
    assert rt.redis.hkeys(owner_input_key(OWNER)) == ([b"file_other"] if refusal == "storage_full" else [])
    assert rt.batches.list(owner=OWNER, status=None, limit=10, cursor=None)[0] == []
    # A message the intake sent before it was refused finds nothing to do, and writes nothing.
    assert submit_chunk(rt, batch_id, 0) == 0 and _score_chunk(rt, batch_id, 0) == 0
    assert batch_keys(rt, batch_id) == []


def test_the_input_counted_grows_with_the_intake_and_is_counted_once(make_rt):
    first, second = block(*((n, "score") for n in range(1, 5))), block(*((n, "score") for n in range(5, 9)))
    cap = stored_bytes(first) + stored_bytes(second) + 10  # the first block counted twice would not fit
    rt = make_rt(batch_max_stored_bytes_per_key=cap)
    rt.redis.flushdb()
    with open_intake(rt, total=8) as intake:
        intake.add(first)
        assert int(rt.redis.hget(owner_input_key(OWNER), intake.batch_id)) == stored_bytes(first)
        intake.add(second)
        assert int(rt.redis.hget(owner_input_key(OWNER), intake.batch_id)) == cap - 10
        intake.close()


def test_the_reaper_discards_an_intake_that_stopped_writing(rt):
    """The API died while reading the file: no one knows the batch; its lines are dropped."""
    rt.redis.flushdb()
    stopped, alive = open_intake(rt, total=8), open_intake(rt, total=8)
    for intake in (stopped, alive):
        intake.add(block(*((n, "score") for n in range(1, 5))))
    rt.redis.hset(f"rq:batch:{stopped.batch_id}", "intake_at", 0)  # its last write, long ago
    rt.redis.zadd(OPEN_KEY, {stopped.batch_id: 0, alive.batch_id: 0})  # both due a look
    BatchReaper(rt, stall_s=60).sweep()
    assert batch_keys(rt, stopped.batch_id) == []
    assert rt.batches.get(alive.batch_id)["status"] == "validating"
    alive.close()
