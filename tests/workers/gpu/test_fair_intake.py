"""The GPU session's intake is fair between keys (issue #56 item 3): what the worker reserved goes
into the scheduler's waiting set at the next step (``Scheduler.intake_room`` covers the worker's
prefetch window), where admission by each key's recent use decides, so key A's backlog of
whole-batch jobs does not keep key B's job behind all of it; a message's place in the buffer no
longer matters.

Real Redis, the real engine on the demo model, the GPU task's session run on the messages as
celery-batches hands them: A's backlog in the first batch, B's message at the session's first
take, while A's first job holds every row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from domain.settings import Settings
from tests.conftest import empty_db_url
from tests.workers.bad_rows import stored_request
from tests.workers.gpu.test_isolation import CpuAndGpuRuntime, submit
from workers.celery_app import create_celery
from workers.gpu.session import GenerateSession
from workers.runtime import runtime

ROWS = 4
KEY_A, KEY_B = "key_a", "key_b"


@pytest.fixture(scope="module")
def rt(redis_url, demo_model_dir, tmp_path_factory):
    settings = Settings(state_dir=tmp_path_factory.mktemp("state"), model=str(demo_model_dir), gpu_batch_size=ROWS)
    app = create_celery(settings, empty_db_url(redis_url, 3))
    app.rollout_runtime_class = CpuAndGpuRuntime
    return runtime(app)


class Arrivals:
    """A first batch of messages, then more at the session's first take (those reserved meanwhile).
    The order the session acknowledges them is the order their jobs ended."""

    flush_every = ROWS

    def __init__(self, first: list[str], later: list[str]):
        self.requests = [self._message(job_id) for job_id in first]
        self._later = [self._message(job_id) for job_id in later]
        self.acknowledged: list[str] = []

    @staticmethod
    def _message(job_id: str):
        return SimpleNamespace(args=[job_id], id=job_id)

    def take(self, limit: int) -> list:
        taken, self._later = self._later[:limit], self._later[limit:]
        return taken

    def acknowledge(self, message_ids: list[str]) -> None:
        self.acknowledged += message_ids


def test_another_keys_job_goes_when_the_whole_batch_job_running_ends_not_after_the_backlog(rt):
    whole_batch = {"ignore_eos": True, "max_tokens": 24, "n": ROWS}
    backlog = [submit(rt, stored_request(token_ids=[100 + i, 101, 102], sampling_params=whole_batch), owner=KEY_A)
               for i in range(4)]
    other = submit(rt, stored_request(token_ids=[120, 121, 122], sampling_params={"ignore_eos": True, "max_tokens": 4}),
                   owner=KEY_B)
    arrivals = Arrivals(backlog, [other])
    GenerateSession(rt, rt.engine, arrivals).run(arrivals.requests)
    assert all(rt.jobs.get(job_id)["status"] == "succeeded" for job_id in [*backlog, other])
    # A's first job held every row when B's message came; B's went next, where the tie between two
    # keys holding no rows used to go to A's older jobs, all of them.
    assert arrivals.acknowledged == [backlog[0], other, *backlog[1:]]
