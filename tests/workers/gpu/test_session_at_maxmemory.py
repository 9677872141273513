"""A GPU session on a Redis at its maxmemory (noeviction refuses every write) fails no job and
does not end: the ends Redis refuses are held, with their tokens, and written once Redis has room
(the messages acknowledged only then); jobs it cannot begin go back to the queue by their own
messages (issue #56: 582 accepted jobs had ended failed / internal_error).

A real Redis of its own with a small bound, the real engine on the demo model, and the GPU task's
body called with the very batch to run, as tests/workers/gpu/test_superseded_session.py does."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis

from domain.infra.redis_server import EmbeddedRedis
from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_job
from domain.settings import Settings
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.gpu.session import GenerateSession
from workers.runtime import runtime
from workers.runtimes import GpuRuntime
from workers.tasks.gpu import settle_after_error

OWNER = "key_owner"
TOKENS = 24
BOUND = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-bound"), persistent=False, maxmemory=BOUND).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def rt(server, demo_model_dir, tmp_path_factory):
    app = create_celery(Settings(state_dir=tmp_path_factory.mktemp("state"), model=str(demo_model_dir)), server.url)
    app.rollout_runtime_class = GpuRuntime
    rt = runtime(app)
    _ = rt.engine  # the model loads before Redis fills
    return rt


@pytest.fixture
def filler(server):
    client = redis.Redis.from_url(server.url)
    yield Filler(client)
    client.delete(*client.keys("fill:*") or ["fill:none"])
    client.close()


class Filler:
    def __init__(self, client: redis.Redis):
        self.client = client

    def fill(self) -> None:
        """Write until Redis refuses even a small write, and again once it has shrunk the buffers
        the big writes grew (its cron frees them within a tick): what is left is no room at all."""
        index = 0
        for _ in range(3):
            wrote = 0
            for size in (20_000, 1_000, 20):
                try:
                    while True:
                        self.client.set(f"fill:{index}", "x" * size)
                        index += 1
                        wrote += 1
                except redis.exceptions.OutOfMemoryError:
                    pass
            if not wrote:
                return
            time.sleep(0.3)

    def free(self) -> None:
        self.client.delete(*self.client.keys("fill:*"))


class Batch:
    """One batch's messages, as celery-batches hands them to the GPU task."""

    flush_every = 16

    def __init__(self, job_ids: list[str]):
        self.requests = [SimpleNamespace(args=[job_id], id=f"message-{job_id}") for job_id in job_ids]
        self.acknowledged: list[str] = []
        self.handed_back: list[str] = []

    def take(self, _limit: int) -> list:
        return []

    def acknowledge(self, message_ids: list[str]) -> None:
        self.acknowledged += message_ids

    def hand_back(self, message_ids: list[str]) -> None:
        self.handed_back += message_ids


def submit(rt) -> str:
    request = JobRequest.from_dict(stored_request(token_ids=[100, 110, 120],
                                                  sampling_params={"max_tokens": TOKENS, "ignore_eos": True}))
    return submit_job(rt.jobs, rt.celery, owner=OWNER, request=request, model=rt.model_facts, watched=True)["id"]


def test_refused_ends_are_held_and_written_once_redis_has_room(rt, filler):
    job_ids = [submit(rt) for _ in range(3)]
    batch = Batch(job_ids)
    seen: dict[str, str] = {}

    def release():
        seen.update({job_id: rt.jobs.get(job_id)["status"] for job_id in job_ids})
        filler.free()

    class FillingSession(GenerateSession):
        """Redis fills at the first step (the jobs' attempts are written); it has room again once
        the session holds the ends it refused."""

        filled = released = False

        def _on_step(self, rows):
            super()._on_step(rows)
            if not self.filled:
                self.filled = True
                filler.fill()

        def _end(self, finished):
            super()._end(finished)
            if self._ends.holding and not self.released:
                self.released = True
                release()

    FillingSession(rt, rt.engine, batch).run(batch.requests)

    assert seen == dict.fromkeys(job_ids, "generating")  # ended in the engine, held while Redis was full
    assert sorted(batch.acknowledged) == sorted(r.id for r in batch.requests) and batch.handed_back == []
    for job_id in job_ids:
        job = rt.jobs.get(job_id)
        assert job["status"] == "succeeded", job.get("error")
        assert len(job["result"]["choices"][0]["token_ids"]) == TOKENS
        events = rt.events.all(job_id)
        streamed = [t for e in events if e.type == "tokens" for t in e.data["choices"][0]["token_ids"]]
        assert streamed == job["result"]["choices"][0]["token_ids"]  # every token, before the end
        assert events[-1].type == "status" and events[-1].data["status"] == "succeeded"


def test_jobs_it_cannot_begin_go_back_to_the_queue_unfailed(rt, filler):
    job_ids = [submit(rt) for _ in range(2)]
    batch = Batch(job_ids)
    filler.fill()
    GenerateSession(rt, rt.engine, batch).run(batch.requests)
    assert sorted(batch.handed_back) == sorted(r.id for r in batch.requests) and batch.acknowledged == []
    assert {rt.jobs.get(job_id)["status"] for job_id in job_ids} <= {"queued", "generating"}


SHORT = 4  # the tokens of the job whose end is held


class ErringSession(GenerateSession):
    """Redis fills at the first step; a step after the short job's end was held, the session meets
    an unexpected error (``then`` runs first: Redis has room again, or not)."""

    def __init__(self, *args, filler: Filler, then=None):
        super().__init__(*args)
        self.filler, self.then, self.steps = filler, then, 0

    def _on_step(self, rows):
        super()._on_step(rows)
        self.steps += 1
        if self.steps == 1:
            self.filler.fill()
        if self._ends.holding and self.steps > SHORT + 2:
            if self.then is not None:
                self.then()
            raise RuntimeError("an unexpected error in the session")


def submit_tokens(rt, max_tokens: int) -> str:
    request = JobRequest.from_dict(stored_request(token_ids=[100, 110, 120],
                                                  sampling_params={"max_tokens": max_tokens, "ignore_eos": True}))
    return submit_job(rt.jobs, rt.celery, owner=OWNER, request=request, model=rt.model_facts)["id"]


def run_until_the_error(rt, filler: Filler, then=None) -> tuple[Batch, ErringSession, str, str]:
    held, running = submit_tokens(rt, SHORT), submit_tokens(rt, 10 * TOKENS)
    batch = Batch([held, running])
    session = ErringSession(rt, rt.engine, batch, filler=filler, then=then)
    with pytest.raises(RuntimeError):
        session.run(batch.requests)
    assert session._ends.holding  # the short job's end, refused
    settle_after_error(rt, session, batch)  # what the GPU task does with the error
    return batch, session, held, running


def test_an_error_while_ends_are_held_hands_their_jobs_back_unfailed(rt, filler):
    """The held end's job goes back to the queue, its prompt kept, where it was acknowledged and
    left to the job reaper; the job still running fails as before (Redis has room again)."""
    batch, session, held, running = run_until_the_error(rt, filler, then=filler.free)
    assert batch.handed_back == [f"message-{held}"] and not session._ends.holding
    assert batch.acknowledged == []  # the task's return settles the rest: only the failed job's is left
    assert rt.jobs.get(held)["status"] == "generating" and rt.jobs.prompts([held]) != [None]
    failed = rt.jobs.get(running)
    assert failed["status"] == "failed" and failed["error"]["code"] == "internal_error"


def test_an_error_while_redis_is_full_hands_every_job_back(rt, filler):
    """Redis still refuses writes: the running job cannot be failed either, and goes back too."""
    batch, _, held, running = run_until_the_error(rt, filler)
    filler.free()
    assert batch.handed_back == [f"message-{held}", f"message-{running}"]
    assert {rt.jobs.get(job_id)["status"] for job_id in (held, running)} == {"generating"}
    assert None not in rt.jobs.prompts([held, running])


def test_a_retry_that_fails_otherwise_still_hands_the_held_jobs_back(rt, filler):
    """A retry of held ends meets an error that is no refusal (as a script's refusal read when
    memory had just fallen below the mark is taken): the ends it took stay held, so the task's
    catch-all hands their jobs back; they were lost with the error, generating until the reaper."""
    job_ids = [submit(rt) for _ in range(2)]
    batch = Batch(job_ids)

    class FailingRetrySession(GenerateSession):
        filled = False

        def _on_step(self, rows):
            super()._on_step(rows)
            if not self.filled:
                self.filled = True
                filler.fill()

        def _flush_tokens(self):
            if self._ends.held.since:  # the first write was refused: its retry fails otherwise
                raise RuntimeError("an error that is no refusal")
            super()._flush_tokens()

    session = FailingRetrySession(rt, rt.engine, batch)
    with pytest.raises(RuntimeError):
        session.run(batch.requests)
    filler.free()
    assert session._ends.holding  # the ends the failed retry took are still there
    settle_after_error(rt, session, batch)
    assert sorted(batch.handed_back) == sorted(r.id for r in batch.requests) and batch.acknowledged == []
    assert {rt.jobs.get(job_id)["status"] for job_id in job_ids} == {"generating"}
    assert None not in rt.jobs.prompts(job_ids)
