"""Prefix affinity across GPU workers (issue #48, item 3), on a real stack with two GPU workers
(the demo model on the CPU): a GRPO group's samples all run on one worker and the fleet computes
each prompt once; a worker that dies with messages in its own queue has them run elsewhere."""

from __future__ import annotations

import time

import pytest

from tests.conftest import empty_db_url
from tests.e2e.conftest import build_stack, log_dir_for, make_stack_env

PROMPT_TOKENS = 40
SAMPLE = {"max_tokens": 4, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    env = make_stack_env(redis_url=empty_db_url(redis_url, 5), model_dir=demo_model_dir,
                         state_dir=tmp_path_factory.mktemp("affinity-state"), loopback=loopback_host,
                         node_id="affinity-node")
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "affinity"),
                     workers=("gpu", ("gpu2", "gpu", None))) as stack:
        yield stack


def prompt(seed: int) -> list[int]:
    return [100 + (seed * 131 + i * 17) % 500 for i in range(PROMPT_TOKENS)]


def counter(stack, name: str) -> int:
    return int(stack.services.redis.hget("rq:metrics:counters", name) or 0)


def test_a_groups_samples_run_on_one_worker_and_each_prompt_is_computed_once(fleet):
    before = counter(fleet, "engine_prefill_tokens")
    groups = {p: [fleet.submit({"token_ids": prompt(p), "sampling_params": {**SAMPLE, "seed": s}})["id"]
                  for s in range(4)] for p in range(6)}
    workers = {}
    for p, jobs in groups.items():
        results = [fleet.wait(job) for job in jobs]
        assert all(r["status"] == "succeeded" for r in results), results
        workers[p] = {r["result"]["nodes"]["generate_worker"] for r in results}
        assert len(workers[p]) == 1, f"prompt {p}'s samples ran on {workers[p]}"
    deadline = time.monotonic() + 15  # each session writes its counters as it ends
    while counter(fleet, "engine_prefill_tokens") - before < 6 * PROMPT_TOKENS and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)  # a session still running would write more within its report interval
    assert counter(fleet, "engine_prefill_tokens") - before == 6 * PROMPT_TOKENS  # six prompts, once each


def test_messages_waiting_for_a_worker_that_died_run_on_another(fleet):
    gone = fleet.heartbeat("gpu2")["direct_queue"]
    # A group that started on gpu2: its late samples follow it there (its prefix's route).
    for seed in range(1000, 1020):
        first = fleet.wait(fleet.submit({"token_ids": prompt(seed), "sampling_params": {**SAMPLE, "seed": 0}})["id"])
        if "generate.gpu." + first["result"]["nodes"]["generate_worker"] == gone:
            break
    else:
        pytest.fail("no new group started on gpu2 in 20 tries")
    fleet.kill("gpu2")  # its heartbeat lingers for its TTL: the router still sends it the group's samples
    jobs = [fleet.submit({"token_ids": prompt(seed), "sampling_params": {**SAMPLE, "seed": s}})["id"]
            for s in range(1, 4)]
    assert fleet.services.redis.llen(gone) == 3
    for job in jobs:  # the drain sends them again once the heartbeat lapses (10 s)
        result = fleet.wait(job, timeout=60)
        assert result["status"] == "succeeded", result
        assert "generate.gpu." + result["result"]["nodes"]["generate_worker"] != gone
    # What the dead worker held comes back to its queue when the held-message sweep restores it;
    # the drain moves that on at its next sweep (a heartbeat apart), so the queue ends empty.
    deadline = time.monotonic() + 15
    while fleet.services.redis.exists(gone) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not fleet.services.redis.exists(gone)
