"""The GPU batch is shared between keys (issue #47, item 2): key A's long rows fill every row of
the GPU worker's batch; key B's short job starts at once (A's newest job is preempted, resumes where
it was and still ends with the tokens it would have had), where it used to wait for A's
rows to end; and key B's job is not queued behind key A's backlog (issue #56 item 3). A real GPU
worker (the demo model on the CPU) with a batch of four rows."""

from __future__ import annotations

import time

import pytest

from tests.conftest import empty_db_url
from tests.e2e.conftest import OTHER_KEY, build_stack, log_dir_for, make_stack_env

ROWS = 4
LONG = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True, "n": 2}
SHORT = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def gpu(redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    env = make_stack_env(redis_url=empty_db_url(redis_url, 17), model_dir=demo_model_dir,
                         state_dir=tmp_path_factory.mktemp("gpu-share-state"), loopback=loopback_host,
                         node_id="gpu-share-node", ROLLOUT_GPU_BATCH_SIZE=str(ROWS))
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "gpu-share"), workers=("gpu",)) as stack:
        yield stack


def status(stack, job_id: str) -> str:
    return stack.services.jobs.get(job_id)["status"]


def tokens(stack, job_id: str) -> list[list[int]]:
    return [choice["token_ids"] for choice in stack.services.jobs.get(job_id)["result"]["choices"]]


def test_a_keys_rows_filling_the_batch_give_way_to_another_keys_short_job(gpu):
    a_jobs = [gpu.submit({"token_ids": [5, 6, 7, 8 + i], "sampling_params": LONG})["id"] for i in range(2)]
    deadline = time.monotonic() + 60
    while not all(status(gpu, job) == "generating" for job in a_jobs):  # A's four rows fill the batch
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    started = time.monotonic()
    b_job = gpu.submit({"token_ids": [9, 10, 11], "sampling_params": SHORT}, key=OTHER_KEY)["id"]
    assert gpu.wait(b_job, timeout=60, key=OTHER_KEY)["status"] == "succeeded"
    b_took = time.monotonic() - started
    unfinished = [job for job in a_jobs if status(gpu, job) != "succeeded"]
    assert unfinished, f"A's 1,500-token rows ended before B's 4 tokens ({b_took:.1f} s): nothing was shared"
    for job in a_jobs:
        assert gpu.wait(job, timeout=300)["status"] == "succeeded"
    assert int(gpu.services.redis.hget("rq:metrics:counters", "engine_preempted_requests") or 0) >= 1
    # The preempted job resumed (its rows' KV computed again): greedy, it ends with what each job gets alone.
    for i, job in enumerate(a_jobs):
        alone = gpu.submit({"token_ids": [5, 6, 7, 8 + i], "sampling_params": LONG})["id"]
        assert gpu.wait(alone, timeout=300)["status"] == "succeeded"
        assert tokens(gpu, job) == tokens(gpu, alone)
        assert all(len(choice) == LONG["max_tokens"] for choice in tokens(gpu, job))


def test_a_keys_backlog_beyond_the_window_does_not_sit_ahead_of_another_keys_job(gpu):
    """Issue #56 item 3: key A's bulk of 40 one-row jobs (five windows of the worker's prefetch of
    8), then key B's job. B's message goes ahead of A's deeper backlog in the queue
    (domain/infra/intake_order.py), so it waits for at most a window of A's, not for all 40."""
    body = {"jobs": [{"token_ids": [20, 21, 22 + i], "sampling_params": {**SHORT, "max_tokens": 48}}
                     for i in range(40)]}
    response = gpu.client.post("/v1/jobs/bulk", json=body, headers=gpu.headers())
    assert response.status_code == 202 and not response.get_json()["refused"], response.get_json()
    a_jobs = [job["id"] for job in response.get_json()["data"]]
    b_job = gpu.submit({"token_ids": [9, 10, 12], "sampling_params": SHORT}, key=OTHER_KEY)["id"]
    b = gpu.wait(b_job, timeout=120, key=OTHER_KEY)
    assert b["status"] == "succeeded"
    ended = [gpu.wait(job, timeout=300) for job in a_jobs]
    assert all(job["status"] == "succeeded" for job in ended)
    after_b_came = [job for job in ended if job["completed_at"] > b["created_at"]]
    overtook = [job for job in after_b_came if job["completed_at"] < b["completed_at"]]
    assert len(after_b_came) >= 3 * 2 * ROWS, "A's backlog was gone before B came: nothing to measure"
    # At most the window A's messages filled before B's came, and the rows running then.
    assert len(overtook) <= 2 * ROWS + ROWS, f"{len(overtook)} of A's jobs ended between B's submit and its end"
