"""A GPU session whose attempt another worker supersedes mid-run drops that job's rows and writes
nothing more for it (no tokens behind the restart, no end, its prompt left to the newer attempt),
while its other jobs end as usual; and a session begins no attempt of a job another live worker
runs (domain/jobs/attempts.py).

Real Redis, the real engine on the demo model, and the GPU task's body called with the very batch
to run, as tests/workers/gpu/test_isolation.py does (database 11 is that module's too: each
module empties it first)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from domain.infra.heartbeats import beat, heartbeat_key
from domain.jobs.attempts import attempt_key
from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_job
from domain.settings import Settings
from tests.conftest import empty_db_url
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.gpu.session import GenerateSession
from workers.runtime import runtime
from workers.runtimes import GpuRuntime

OWNER = "key_owner"
OTHER = "other-node-7"  # the worker that redid the job while this one seemed dead
LONG = {"max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def rt(redis_url, demo_model_dir, tmp_path_factory):
    app = create_celery(Settings(state_dir=tmp_path_factory.mktemp("state"), model=str(demo_model_dir)),
                        empty_db_url(redis_url, 11))
    app.rollout_runtime_class = GpuRuntime
    return runtime(app)


class Batch:
    """One batch's messages, as celery-batches hands them to the GPU task; between steps (``take``)
    ``between_steps`` runs once, at the given step."""

    flush_every = 16

    def __init__(self, job_ids: list[str], *, at_step: int = 0, between_steps=None):
        self.requests = [SimpleNamespace(args=[job_id], id=f"message-{job_id}") for job_id in job_ids]
        self.acknowledged: list[str] = []
        self.steps, self.at_step, self.between_steps = 0, at_step, between_steps

    def take(self, _limit: int) -> list:
        self.steps += 1
        if self.between_steps is not None and self.steps == self.at_step:
            self.between_steps()
        return []

    def acknowledge(self, message_ids: list[str]) -> None:
        self.acknowledged += message_ids


def submit(rt, **sampling) -> str:
    request = JobRequest.from_dict(stored_request(token_ids=[100, 110, 120], sampling_params=sampling))
    return submit_job(rt.jobs, rt.celery, owner=OWNER, request=request, model=rt.model_facts, watched=True)["id"]


def test_a_superseded_attempt_is_dropped_at_its_next_step_and_its_batch_mates_end(rt):
    taken, kept = submit(rt, **LONG), submit(rt, **LONG)
    # Mid-run, another worker begins attempt 2 of one job (this one's heartbeat had lapsed).
    batch = Batch([taken, kept], at_step=5,
                  between_steps=lambda: rt.events.begin_attempts([taken], holder=heartbeat_key("gpu", OTHER)))
    GenerateSession(rt, rt.engine, batch).run(batch.requests)

    assert sorted(batch.acknowledged) == sorted(r.id for r in batch.requests)  # both messages settled
    assert rt.jobs.get(kept)["status"] == "succeeded"
    assert rt.jobs.get(taken)["status"] == "generating"  # attempt 2 ends it, not this session
    assert rt.jobs.prompts([taken]) != [None]  # still there for attempt 2
    events = [(e.type, e.data.get("attempt")) for e in rt.events.all(taken)]
    restart = events.index(("restart", 2))
    assert ("tokens", 1) in events[:restart] and ("tokens", 1) not in events[restart:]
    written = sum(len(e.data["choices"][0]["token_ids"]) for e in rt.events.all(taken) if e.type == "tokens")
    assert written < LONG["max_tokens"]  # stopped at its next step, not run to its end


def test_a_session_begins_no_attempt_of_a_job_another_live_worker_runs(rt):
    job_id = submit(rt, **LONG)
    rt.jobs.advance(job_id, "generating", owner=OWNER)
    rt.events.begin_attempts([job_id], holder=heartbeat_key("gpu", OTHER))
    beat(rt.redis, "gpu", OTHER, {"running": [job_id]})  # alive, and running it
    batch = Batch([job_id])
    GenerateSession(rt, rt.engine, batch).run(batch.requests)  # a duplicate of the message OTHER holds
    assert batch.acknowledged == [f"message-{job_id}"]
    assert int(rt.redis.get(attempt_key(job_id))) == 1
    assert rt.jobs.get(job_id)["status"] == "generating"
    assert [e.type for e in rt.events.all(job_id)].count("restart") == 0
