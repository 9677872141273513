"""One request that makes the engine raise fails its own job only, whatever it raised: the GPU task
splits the batch, and every other job of it completes with the result it gets alone.

Real Redis, the real engine on the demo model, and the GPU task's body called with the very batch
to run (no worker consumes: the batch is exactly the jobs given). Key A's bad rows are written
through the submission layer, past the API's checks (tests/workers/bad_rows.py)."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import pytest
from PIL import Image

from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_job
from domain.settings import Settings
from tests.conftest import empty_db_url
from tests.workers.bad_rows import plant_job, plant_mismatched_image_job, stored_request
from workers.celery_app import create_celery
from workers.gpu.session import GenerateSession
from workers.runtime import runtime
from workers.runtimes import CpuRuntime, GpuRuntime
from workers.tasks.score_lines import _score

KEY_A, KEY_B = "key_a", "key_b"
GOOD = [stored_request(token_ids=[100 + n, 110, 120]) for n in range(3)] + [
    stored_request(kind="score", token_ids=[100 + n, 101, 102], completion_token_ids=[110 + n, 111, 112])
    for n in range(3)]


@pytest.fixture(scope="module")
def rt(redis_url, demo_model_dir, tmp_path_factory):
    app = create_celery(Settings(state_dir=tmp_path_factory.mktemp("state"), model=str(demo_model_dir)),
                        empty_db_url(redis_url, 11))
    app.rollout_runtime_class = CpuAndGpuRuntime
    return runtime(app)


class CpuAndGpuRuntime(GpuRuntime, CpuRuntime):
    """These tests plant jobs as a CPU worker makes them and run them as the GPU worker does."""


class OneBatch:
    """The messages of exactly one batch, in the shape celery-batches hands the GPU task (the
    session asks for more between steps: there are none)."""

    flush_every = 16

    def __init__(self, job_ids: list[str]):
        self.requests = [SimpleNamespace(args=[job_id], id=f"message-{job_id}") for job_id in job_ids]
        self.acknowledged: list[str] = []

    def take(self, _limit: int) -> list:
        return []

    def acknowledge(self, message_ids: list[str]) -> None:
        self.acknowledged += message_ids


def run_batch(rt, job_ids: list[str]) -> None:
    """The GPU task's body on exactly ``job_ids``: one session, every message settled."""
    batch = OneBatch(job_ids)
    GenerateSession(rt, rt.engine, batch).run(batch.requests)
    assert sorted(batch.acknowledged) == sorted(r.id for r in batch.requests)


def image_data_url() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def submit(rt, request: dict, owner: str = KEY_B) -> str:
    return submit_job(rt.jobs, rt.celery, owner=owner, request=JobRequest.from_dict(request), model=rt.model_facts)["id"]


def outcome(job: dict):
    """What a trainer reads of a job: tokens and logprobs, or the completion's logprobs."""
    result = job["result"]
    if job["kind"] == "score":
        return result["completion_logprobs"]
    return [(c["token_ids"], c["logprobs"], c["finish_reason"]) for c in result["choices"]]


def assert_same(got, want) -> None:
    if got and isinstance(got[0], tuple):
        assert [c[0] for c in got] == [c[0] for c in want] and [c[2] for c in got] == [c[2] for c in want]
        got, want = [lp for c in got for lp in c[1]], [lp for c in want for lp in c[1]]
    assert got == pytest.approx(want, abs=1e-5)


def test_bad_rows_of_one_key_fail_alone_and_the_batch_completes(rt):
    vocab = rt.model_facts.vocab_size
    good = [submit(rt, request) for request in GOOD]
    bad_ids = {
        "completion": plant_job(rt.jobs, rt.celery, rt.model_facts, KEY_A, kind="score", token_ids=[100, 101],
                                completion_token_ids=[110, vocab + 7]),
        "prompt": plant_job(rt.jobs, rt.celery, rt.model_facts, KEY_A, token_ids=[100, vocab + 1000, 102]),
        "untyped": plant_mismatched_image_job(rt.jobs, rt.celery, KEY_A, processor=rt.processor, fetcher=rt.fetcher,
                                              image_url=image_data_url()),
    }
    # A's rows sit between B's, in one call of the task's body: one generate and one score batch.
    batch = [good[0], bad_ids["prompt"], good[1], bad_ids["untyped"], good[2],
             good[3], bad_ids["completion"], good[4], good[5]]
    run_batch(rt, batch)

    jobs = {job_id: rt.jobs.get(job_id) for job_id in batch}
    assert [jobs[job_id]["status"] for job_id in good] == ["succeeded"] * len(good), [
        jobs[job_id].get("error") for job_id in good]
    bad = {name: jobs[job_id] for name, job_id in bad_ids.items()}
    assert {name: (job["status"], job["error"]["code"]) for name, job in bad.items()} == {
        "completion": ("failed", "token_id_out_of_range"), "prompt": ("failed", "token_id_out_of_range"),
        "untyped": ("failed", "internal_error")}
    assert bad["untyped"]["error"]["message"] == "internal error while generating"  # no exception text

    for request, job_id in zip(GOOD, good, strict=True):
        alone = submit(rt, request)
        run_batch(rt, [alone])
        alone_job = rt.jobs.get(alone)
        assert alone_job["result"]["timings"]["batch_size"] == 1
        assert_same(outcome(jobs[job_id]), outcome(alone_job))


def test_direct_score_lines_fail_alone_whatever_they_raise(rt):
    """Plain score lines of a batch are scored without jobs (workers/tasks/score_lines.py): the same
    rule holds there."""
    vocab = rt.model_facts.vocab_size

    def line(number, completion):
        return {"line": number, "custom_id": f"c{number}",
                "request": {"kind": "score", "token_ids": [100, 101, 102], "completion_token_ids": completion}}

    lines = [line(1, [110, 111]), line(2, [110, vocab]), line(3, [112]), line(4, None), line(5, [113, 114])]
    entries = {number: (ok, entry) for number, ok, entry in _score(rt.engine, lines)}
    assert sorted(entries) == [1, 2, 3, 4, 5]
    assert [entries[n][0] for n in (1, 3, 5)] == [True] * 3
    assert entries[2][1]["error"]["code"] == "token_id_out_of_range"
    assert entries[4][1]["error"] == {"code": "internal_error", "message": "internal error while scoring"}
    for n in (1, 3, 5):
        [(alone_ok, alone)] = [(ok, entry) for _, ok, entry in _score(rt.engine, [lines[n - 1]])]
        assert alone_ok and entries[n][1]["response"]["body"]["completion_logprobs"] == pytest.approx(
            alone["response"]["body"]["completion_logprobs"], abs=1e-5)
