"""A weight update lands mid-row in each mode, in a real GPU session (real Redis, the engine on
the demo model, the weight watcher): each result's weight_versions spans name the weights of the
tokens they cover, and each token's logprob is that version's forward (tests/version_refs.py,
transformers directly). finish: the row ends on the old weights; abort: it ends there with its
tokens so far; retract: it runs again, wholly on the new weights; keep: it goes on under the new
weights attending to the old KV, or with its KV computed again (recompute_kv), and a row that may
cross no update (max_policy_lag 0) ends "policy_lag" at the swap. Database 28 is this module's."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_job
from domain.settings import Settings
from engine.demo_model import build_demo_model
from engine.loading import load_model
from tests.conftest import empty_db_url
from tests.version_refs import old_kv_then_new, teacher_forced
from tests.workers.bad_rows import stored_request
from workers.celery_app import create_celery
from workers.gpu.session import GenerateSession
from workers.runtime import runtime
from workers.runtimes import GpuRuntime

OWNER = "key_owner"
PROMPT = [100, 110, 120, 130, 140]
TOKENS = 40
ATOL = 2e-5


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights-root")
    for seed in (1, 2):
        build_demo_model(root / f"seed-{seed}", seed=seed)
    return root


@pytest.fixture(scope="module")
def rt(redis_url, demo_model_dir, root, tmp_path_factory):
    settings = Settings(state_dir=tmp_path_factory.mktemp("state"), model=str(demo_model_dir), weights_root=root)
    app = create_celery(settings, empty_db_url(redis_url, 28))
    app.rollout_runtime_class = GpuRuntime
    rt = runtime(app)
    rt.weight_sync.start()  # the watcher a GPU worker starts with its model
    yield rt
    rt.weight_sync.stop()


@pytest.fixture(scope="module")
def models(demo_model_dir, root):
    """Each weights directory as a plain transformers model, by what the test's target names."""
    return {path: load_model(str(directory), device="cpu").model.eval()
            for path, directory in [("start", demo_model_dir), ("seed-1", root / "seed-1"),
                                    ("seed-2", root / "seed-2")]}


class Served:
    """Which directory serves now (each test moves the fleet to the other seed)."""

    path = "start"


class Batch:
    """One batch's messages; at its ``at``-th step the update is set and seen by the watcher."""

    flush_every = 16

    def __init__(self, job_ids: list[str], *, at: int = 0, update=None):
        self.requests = [SimpleNamespace(args=[job_id], id=f"message-{job_id}") for job_id in job_ids]
        self.acknowledged: list[str] = []
        self.steps, self.at, self.update = 0, at, update

    def take(self, _limit: int) -> list:
        self.steps += 1
        if self.update is not None and self.steps == self.at:
            self.update()
        return []

    def acknowledge(self, message_ids: list[str]) -> None:
        self.acknowledged += message_ids


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _submit(rt, **sampling) -> str:
    request = JobRequest.from_dict(stored_request(token_ids=PROMPT, sampling_params={
        "max_tokens": TOKENS, "ignore_eos": True, "logprobs": True, **sampling}))
    return submit_job(rt.jobs, rt.celery, owner=OWNER, request=request, model=rt.model_facts)["id"]


def _run_with_update(rt, mode: str, *, recompute_kv: bool = False, **sampling):
    """Run one job; at its fifth step the fleet's target moves to the other seed in ``mode``.
    Returns (job id, old directory, new directory, new version)."""
    old = Served.path
    new = "seed-2" if old == "seed-1" else "seed-1"
    version = f"{mode}-{recompute_kv}-{time.monotonic_ns()}"
    sync = rt.weight_sync

    def update():
        rt.weight_store.set_target(version=version, model_path=new, mode=mode, recompute_kv=recompute_kv)
        _wait(lambda: sync.update_pending)

    job_id = _submit(rt, **sampling)
    batch = Batch([job_id], at=5, update=update)
    GenerateSession(rt, rt.engine, batch).run(batch.requests)
    _wait(lambda: rt.engine.weight_version == version)  # an idle worker converges too (finish, abort)
    Served.path = new
    return job_id, old, new, version


def _choice(rt, job_id):
    job = rt.jobs.get(job_id)
    assert job["status"] == "succeeded", job
    return job["result"], job["result"]["choices"][0]


def test_finish_ends_the_row_on_the_old_weights(rt, models):
    before = rt.engine.weight_version
    job_id, old, _, _ = _run_with_update(rt, "finish")
    result, choice = _choice(rt, job_id)
    assert choice["finish_reason"] == "length" and result["weight_version"] == before
    assert choice["weight_versions"] == [{"version": before, "start": 0, "end": TOKENS}]
    assert choice["kv_recomputed"] is None
    assert choice["logprobs"] == pytest.approx(teacher_forced(models[old], PROMPT, choice["token_ids"]), abs=ATOL)


def test_abort_ends_the_row_with_its_old_tokens(rt, models):
    before = rt.engine.weight_version
    job_id, old, _, _ = _run_with_update(rt, "abort")
    result, choice = _choice(rt, job_id)
    count = len(choice["token_ids"])
    assert choice["finish_reason"] == "abort" and 0 < count < TOKENS
    assert choice["weight_versions"] == [{"version": before, "start": 0, "end": count}]
    assert choice["logprobs"] == pytest.approx(teacher_forced(models[old], PROMPT, choice["token_ids"]), abs=ATOL)


def test_retract_runs_the_job_again_wholly_on_the_new_weights(rt, models):
    job_id, _, new, version = _run_with_update(rt, "retract")
    assert "result" not in rt.jobs.get(job_id)  # sent back to the queue; run its message here again
    batch = Batch([job_id])
    GenerateSession(rt, rt.engine, batch).run(batch.requests)
    result, choice = _choice(rt, job_id)
    assert choice["weight_versions"] == [{"version": version, "start": 0, "end": TOKENS}]
    assert result["weight_version"] == version
    assert choice["logprobs"] == pytest.approx(teacher_forced(models[new], PROMPT, choice["token_ids"]), abs=ATOL)


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_keep_goes_on_under_the_new_weights_from_where_the_row_was(rt, models, recompute_kv):
    before = rt.engine.weight_version
    job_id, old, new, version = _run_with_update(rt, "keep", recompute_kv=recompute_kv)
    result, choice = _choice(rt, job_id)
    tokens = choice["token_ids"]
    first, second = choice["weight_versions"]
    at = first["end"]
    assert choice["finish_reason"] == "length" and len(tokens) == TOKENS and 0 < at < TOKENS
    assert first == {"version": before, "start": 0, "end": at}
    assert second == {"version": version, "start": at, "end": TOKENS}
    assert result["weight_version"] == version and choice["kv_recomputed"] is recompute_kv
    after = (teacher_forced(models[new], PROMPT, tokens)[at:] if recompute_kv
             else old_kv_then_new(models[old], models[new], PROMPT, tokens, at))
    assert choice["logprobs"] == pytest.approx(teacher_forced(models[old], PROMPT, tokens)[:at] + after, abs=ATOL)


def test_keep_ends_a_row_that_may_cross_no_update_with_policy_lag(rt, models):
    before = rt.engine.weight_version
    job_id, old, _, version = _run_with_update(rt, "keep", max_policy_lag=0)
    result, choice = _choice(rt, job_id)
    count = len(choice["token_ids"])
    assert choice["finish_reason"] == "policy_lag" and 0 < count < TOKENS
    assert choice["weight_versions"] == [{"version": before, "start": 0, "end": count}]
    assert result["weight_version"] == before != version
    assert choice["logprobs"] == pytest.approx(teacher_forced(models[old], PROMPT, choice["token_ids"]), abs=ATOL)


def test_a_pause_in_mode_keep_holds_rows_still_until_it_ends(rt, models):
    """SGLang's pause_generation in_place: the rows stop between steps and go on after continue."""
    held = []

    def pause():
        rt.weight_store.pause("in_place")
        _wait(lambda: rt.weight_sync.holds_rows)
        resume_later = time.monotonic() + 0.5

        def resume():
            while time.monotonic() < resume_later:
                time.sleep(0.01)
            held.append(len(rt.jobs.get(job_id).get("result") or {}))
            rt.weight_store.resume()
        threading.Thread(target=resume, daemon=True).start()

    before = rt.engine.weight_version
    job_id = _submit(rt)
    batch = Batch([job_id], at=5, update=pause)
    started = time.monotonic()
    GenerateSession(rt, rt.engine, batch).run(batch.requests)
    _, choice = _choice(rt, job_id)
    assert time.monotonic() - started >= 0.5 and held == [0]  # still running while paused
    assert choice["finish_reason"] == "length"
    assert choice["weight_versions"] == [{"version": before, "start": 0, "end": TOKENS}]
    assert choice["logprobs"] == pytest.approx(
        teacher_forced(models[Served.path], PROMPT, choice["token_ids"]), abs=ATOL)


def test_an_update_during_an_in_place_pause_is_taken_in_mode_keep(rt, models):
    """SGLang's refit: pause_generation in_place, update_weights_from_disk (mode finish), then
    continue_generation: the held rows go on under the new weights from where they were."""
    before, old = rt.engine.weight_version, Served.path
    new = "seed-2" if old == "seed-1" else "seed-1"
    version = f"in-place-{time.monotonic_ns()}"

    def refit():
        rt.weight_store.pause("in_place")
        _wait(lambda: rt.weight_sync.holds_rows)
        rt.weight_store.set_target(version=version, model_path=new, mode="finish")

        def resume():
            _wait(lambda: rt.engine.weight_version == version)
            rt.weight_store.resume()
        threading.Thread(target=resume, daemon=True).start()

    job_id = _submit(rt)
    batch = Batch([job_id], at=5, update=refit)
    GenerateSession(rt, rt.engine, batch).run(batch.requests)
    Served.path = new
    result, choice = _choice(rt, job_id)
    tokens = choice["token_ids"]
    first, second = choice["weight_versions"]
    at = first["end"]
    assert first == {"version": before, "start": 0, "end": at} and 0 < at < TOKENS
    assert second == {"version": version, "start": at, "end": TOKENS} and choice["kv_recomputed"] is False
    expected = (teacher_forced(models[old], PROMPT, tokens)[:at]
                + old_kv_then_new(models[old], models[new], PROMPT, tokens, at))
    assert choice["logprobs"] == pytest.approx(expected, abs=ATOL)
