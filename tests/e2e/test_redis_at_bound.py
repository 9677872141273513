"""Redis at its bound loses no accepted job (issue #56 item 1): a stack on a Redis with a small
maxmemory takes legal jobs in bulk until the API refuses with ``redis_memory_full``; then Redis is
filled to its bound from outside, by keys that expire as results do (what admission's reservation
cannot see: another writer, an estimate missed), so the workers' writes are refused while the jobs
run. Every accepted job ends ``succeeded`` as that memory frees (a short ``ROLLOUT_RESULT_TTL``),
nothing stays held or unfinished, and the GPU worker takes work after.

Its own Redis and workers (a CPU worker too: a queued job whose prompt expired is preprocessed
again). What the run saw, the peak of Redis' memory and the refusals the workers rode out, is
printed with the figures."""

from __future__ import annotations

import time

import pytest
import redis

from domain.infra.redis_server import EmbeddedRedis
from domain.jobs.keys import UNFINISHED_KEY
from tests.e2e.conftest import build_stack, log_dir_for, make_stack_env

BOUND = 4 * 1024 * 1024
TTL = 3
# Each job's result is about 50 KB (64 tokens with 20 top logprobs each): the jobs of one batch,
# ending in the same step, outgrow the room left above what the stack holds idle.
JOB = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 64, "ignore_eos": True, "top_logprobs": 20}}
BULK = 24
MOST_JOBS = 72


@pytest.fixture(scope="module")
def bound_redis(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-bound"), persistent=False, maxmemory=BOUND).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(bound_redis, demo_model_dir, loopback_host, tmp_path_factory):
    env = make_stack_env(redis_url=bound_redis.url, model_dir=demo_model_dir,
                         state_dir=tmp_path_factory.mktemp("state"), loopback=loopback_host,
                         ROLLOUT_RESULT_TTL=str(TTL))
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "redis-bound"), workers=("cpu", "gpu")) as s:
        yield s


def submit_until_refused(stack) -> list[str]:
    accepted: list[str] = []
    while len(accepted) < MOST_JOBS:
        response = stack.client.post("/v1/jobs/bulk", json={"jobs": [JOB] * BULK}, headers=stack.headers())
        if response.status_code == 503:
            assert response.get_json()["code"] == "redis_memory_full"
            break
        assert response.status_code == 202, response.get_json()
        accepted += [job["id"] for job in response.get_json()["data"] if job is not None]
        time.sleep(0.05)
    return accepted


def fill_to_the_bound(client: redis.Redis, expire_s: int) -> None:
    """Write keys that expire in ``expire_s`` until Redis refuses even a small one."""
    index = 0
    for size in (20_000, 1_000, 20):
        try:
            while True:
                client.set(f"ballast:{index}", "x" * size, ex=expire_s)
                index += 1
        except redis.exceptions.OutOfMemoryError:
            pass


def watch_until_ended(stack, job_ids: list[str], client: redis.Redis, timeout: float) -> tuple[dict, float]:
    """Each job's terminal status, read before its record expires; and the peak of Redis' memory."""
    ended: dict[str, str] = {}
    peak = 0.0
    deadline = time.monotonic() + timeout
    while len(ended) < len(job_ids) and time.monotonic() < deadline:
        open_ids = [job_id for job_id in job_ids if job_id not in ended]
        for job_id, summary in zip(open_ids, stack.services.jobs.summaries(open_ids), strict=True):
            if summary is None:
                ended[job_id] = "expired unseen"  # ended and expired between two looks: not expected
            elif summary["status"] in ("succeeded", "failed", "cancelled"):
                ended[job_id] = summary["status"]
        memory = client.info("memory")
        peak = max(peak, int(memory["used_memory"]) / int(memory["maxmemory"]))
        time.sleep(0.2)
    return ended, peak


def test_every_accepted_job_succeeds_at_the_bound_and_nothing_stays_stuck(stack, bound_redis):
    client = redis.Redis.from_url(bound_redis.url)
    started = time.monotonic()
    accepted = submit_until_refused(stack)
    assert accepted
    fill_to_the_bound(client, TTL)
    ended, peak = watch_until_ended(stack, accepted, client, timeout=120)
    took = time.monotonic() - started
    log = (stack.log_dir / "worker-gpu.log").read_text(errors="replace")
    print(f"\naccepted {len(accepted)}, succeeded {sum(s == 'succeeded' for s in ended.values())}, "
          f"peak Redis memory {peak:.0%} of {BOUND} bytes, held ends {log.count('job ends held')}, "
          f"handed back {log.count('go back to the queue')}, "
          f"{took:.1f} s")
    stuck = [job_id for job_id in accepted if job_id not in ended]
    assert not stuck, f"{len(stuck)} accepted jobs never ended"
    assert set(ended.values()) == {"succeeded"}, {s: list(ended.values()).count(s) for s in set(ended.values())}


    # Nothing held, queued or unfinished; the GPU worker still takes work.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (client.zcard(UNFINISHED_KEY) or stack.heartbeat("gpu")["held"]):
        time.sleep(0.2)
    assert client.zcard(UNFINISHED_KEY) == 0 and stack.heartbeat("gpu")["held"] == []
    after = stack.submit({"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}})
    assert stack.wait(after["id"], timeout=30)["status"] == "succeeded"
