"""Redis at its bound (issue #56 item 1): accepted jobs lost, goal 0.

The issue's run, scaled to a CPU machine: a Redis with a small ``maxmemory`` (noeviction), one key's
bulk submits of 50 legal jobs with large results (64 tokens with 20 top logprobs each, about 50 KB
a result), sent until the API answers 503 ``redis_memory_full`` (or :data:`MOST_JOBS` are in),
while a CPU and a GPU worker run them and results expire after ``ROLLOUT_RESULT_TTL`` seconds.
Admission reserves each job's result, so legal jobs alone no longer take Redis to its bound: after
each bulk, keys that expire as results do fill it to the bound (another writer, an estimate
missed), and the workers' writes are refused while the jobs run. Each accepted job's end is read
before its record expires. Lost: an accepted job that ended other than
``succeeded`` or had not ended :data:`DEADLINE_S` seconds after the last submit (the issue's run
lost 582 to ``internal_error`` and left 1,161 waiting, the GPU worker stopped for good).

    python -m bench.redis_bound
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import redis

from bench.stack import HEADERS, Service
from engine.demo_model import build_demo_model

BOUND = 8 * 1024 * 1024
TTL_S = 5
BULK = 50
MOST_JOBS = 300
DEADLINE_S = 120.0
JOB = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 64, "ignore_eos": True, "top_logprobs": 20}}


def fill_to_the_bound(client: redis.Redis) -> None:
    """Write keys that expire with results (``TTL_S``) until Redis refuses even a small one."""
    index = 0
    for size in (20_000, 1_000, 20):
        try:
            while True:
                client.set(f"bench:ballast:{time.monotonic_ns()}:{index}", "x" * size, ex=TTL_S)
                index += 1
        except redis.exceptions.OutOfMemoryError:
            pass


def at_bound(service: Service) -> dict:
    """Submit until refused, then follow every accepted job to its end: the figures."""
    redis = service.svc.redis
    accepted: list[str] = []
    refused_at = None
    peak = 0.0
    started = time.monotonic()
    while len(accepted) < MOST_JOBS:
        response = service.client.post("/v1/jobs/bulk", json={"jobs": [JOB] * BULK}, headers=HEADERS)
        if response.status_code == 503:
            refused_at = response.get_json()["errors"]["used_bytes"] / BOUND
            break
        accepted += [job["id"] for job in response.get_json()["data"] if job is not None]
        fill_to_the_bound(service.svc.redis)
        peak = max(peak, int(redis.info("memory")["used_memory"]) / BOUND)
        time.sleep(TTL_S)  # the ballast expires: admission takes work again
    ended: dict[str, str] = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(ended) < len(accepted) and time.monotonic() < deadline:
        waiting = [job_id for job_id in accepted if job_id not in ended]
        for job_id, summary in zip(waiting, service.svc.jobs.summaries(waiting), strict=True):
            if summary is None:
                ended[job_id] = "expired before seen"
            elif summary["status"] in ("succeeded", "failed", "cancelled"):
                ended[job_id] = summary["status"]
        memory = redis.info("memory")
        peak = max(peak, int(memory["used_memory"]) / BOUND)
        time.sleep(0.2)
    succeeded = sum(status == "succeeded" for status in ended.values())
    log = (service.state / "worker-gpu.log").read_text(errors="replace")
    return {"accepted": len(accepted), "succeeded": succeeded, "lost": len(accepted) - succeeded,
            "peak": peak, "refused_at": refused_at, "seconds": time.monotonic() - started,
            "held": log.count("job ends held"), "handed_back": log.count("go back to the queue")}


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "model")
        service = Service(Path(tmp) / "state", model_dir, workers=("cpu", "gpu"), result_ttl=TTL_S)
        try:
            service.svc.redis.config_set("maxmemory", BOUND)  # the embedded server runs noeviction
            service.start_workers()
            service.wait_ready()
            figures = at_bound(service)
        finally:
            service.close()
    refused = "not refused" if figures["refused_at"] is None else f"refused at {figures['refused_at']:.0%}"
    return [{"name": f"Redis at its {BOUND >> 20} MiB bound: accepted jobs lost ({figures['accepted']} accepted, "
                     f"{figures['succeeded']} succeeded, {refused}, peak {figures['peak']:.0%}, GPU worker: "
                     f"{figures['held']} times ends held, {figures['handed_back']} batches handed back; "
                     f"{figures['seconds']:.0f} s)",
             "value": figures["lost"], "goal": "<= 0"}]


if __name__ == "__main__":
    from bench.rows import print_rows

    print_rows(run())
