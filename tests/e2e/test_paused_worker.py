"""A worker that only seems dead: paused (SIGSTOP) mid-job past its heartbeat's TTL, its messages
run on a second worker, then it wakes (SIGCONT). One attempt, the newest, is the job: its tokens
are the record's, the stream's (read as README says: a ``restart`` voids older attempts) and the
webhook's, and the woken worker writes nothing more for the job (domain/jobs/attempts.py).

Heartbeats beat every 0.5 s here (a 2.5 s TTL), so a pause of a few seconds is a death."""

from __future__ import annotations

import json

from domain.jobs.attempts import attempt_key, holder_key, preprocess_key
from tests.conftest import empty_db_url
from tests.e2e.conftest import build_stack, log_dir_for, make_stack_env
from tests.e2e.job_checks import assert_one_webhook_each, wait_until
from tests.media_files import png_bytes

FAST_BEATS = {"ROLLOUT_HEARTBEAT_SECONDS": "0.5", "ROLLOUT_VISIBILITY_TIMEOUT": "3600"}
HOOK = "/hooks/paused"


def stack_env(redis_url, demo_model_dir, loopback_host, tmp_path_factory, name: str, **overrides):
    # Database 20 is the GPU worker death tests' too: each test empties it first.
    return make_stack_env(redis_url=empty_db_url(redis_url, 20), model_dir=demo_model_dir,
                          state_dir=tmp_path_factory.mktemp(f"{name}-state"), loopback=loopback_host,
                          **FAST_BEATS, **overrides)


def generation(max_tokens: int) -> dict:
    # Unseeded sampling: two attempts of a job draw different tokens, so the record shows whose it is.
    return {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}


def attempt_tokens(stack, job_id: str) -> dict[int, list[int]]:
    """Choice 0's tokens in the job's stream, by attempt, each attempt's from its entries' offsets."""
    by_attempt: dict[int, list[int]] = {}
    for event in stack.services.events.all(job_id):
        if event.type == "tokens":
            for choice in event.data["choices"]:
                if choice["index"] == 0:
                    tokens = by_attempt.setdefault(event.data["attempt"], [])
                    assert choice["offset"] == len(tokens), (job_id, event)
                    tokens.extend(choice["token_ids"])
    return by_attempt


def stream_as_read(stack, job_id: str) -> list[int]:
    """What a native stream reader keeps: the newest attempt's tokens, older ones dropped at ``restart``."""
    kept, attempt = [], 1
    for event in stack.services.events.all(job_id):
        if event.type == "restart":
            kept, attempt = [], event.data["attempt"]
        elif event.type == "tokens":
            assert event.data["attempt"] == attempt, f"{job_id}: a void attempt wrote after its restart: {event}"
            kept += next(c["token_ids"] for c in event.data["choices"] if c["index"] == 0)
    return kept


def webhook_tokens(host, job_id: str) -> list[int]:
    bodies = [json.loads(body) for _m, _h, body in host.requests[HOOK] if json.loads(body)["data"]["id"] == job_id]
    return bodies[0]["data"]["result"]["choices"][0]["token_ids"]


def assert_one_attempts_tokens_everywhere(stack, ids: list[str]) -> None:
    assert_one_webhook_each(stack.host, ids, HOOK)
    for job_id in ids:
        job = stack.wait(job_id, timeout=60)
        assert job["status"] == "succeeded", job
        record = job["result"]["choices"][0]["token_ids"]
        assert stream_as_read(stack, job_id) == record
        assert webhook_tokens(stack.host, job_id) == record


def worker_of(stack, heartbeat: bytes | None) -> str | None:
    """The stack's name of the worker whose heartbeat key this is (it ends with the worker's pid)."""
    if heartbeat is None:
        return None
    return next((name for name, process in stack.workers.items() if heartbeat.decode().endswith(f"-{process.pid}")),
                None)


def test_a_gpu_worker_paused_past_its_heartbeat_writes_nothing_once_another_attempt_runs(
        redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    env = stack_env(redis_url, demo_model_dir, loopback_host, tmp_path_factory, "paused-gpu")
    workers = (("gpu-a", "gpu", None), ("gpu-b", "gpu", None), "webhooks")
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "paused-gpu"), workers=workers) as stack:
        redis = stack.services.redis
        hook = {"url": stack.host.url(HOOK)}
        ids = [stack.submit({"token_ids": [100 + i, 140, 150], "sampling_params": generation(500),
                             "stream_events": True, "webhook": hook})["id"] for i in range(4)]

        # The first job well into its attempt: pause the worker that runs it.
        def one_running():
            return next((job_id for job_id in ids if len(attempt_tokens(stack, job_id).get(1, ())) >= 20), None)

        first = wait_until(one_running, 60, "a job's first tokens")
        paused = worker_of(stack, redis.get(holder_key(first)))
        assert paused is not None
        stack.pause(paused)
        try:
            held = [job_id for job_id in ids if worker_of(stack, redis.get(holder_key(job_id))) == paused]
            # Its heartbeat lapses, its messages go back, and the other worker begins attempt 2.
            wait_until(lambda: all(int(redis.get(attempt_key(job_id)) or 0) >= 2 for job_id in held), 30,
                       "attempt 2 of the paused worker's jobs")
        finally:
            stack.resume(paused)  # attempt 1 is far ahead: unfenced, it would end first
        assert_one_attempts_tokens_everywhere(stack, ids)
        for job_id in held:
            job = stack.services.jobs.get(job_id)
            record, by_attempt = job["result"]["choices"][0]["token_ids"], attempt_tokens(stack, job_id)
            assert by_attempt[2] == record and by_attempt[1] != record[:len(by_attempt[1])]
            assert job["result"]["nodes"]["generate_worker"].endswith(f"-{stack.workers['gpu-b' if paused == 'gpu-a' else 'gpu-a'].pid}")
        # The woken worker is alive and dropped the jobs it no longer held.
        beat = wait_until(lambda: stack.heartbeat(paused), 10, "the woken worker's heartbeat")
        assert not set(beat.get("running", ())) & set(held)


def test_a_cpu_worker_paused_mid_fetch_sends_no_generate_once_another_run_did(
        redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    env = stack_env(redis_url, demo_model_dir, loopback_host, tmp_path_factory, "paused-cpu",
                    ROLLOUT_CPU_CONCURRENCY="1", ROLLOUT_FETCH_TIMEOUT="30")
    workers = (("cpu-a", "cpu", None), ("cpu-b", "cpu", None), "gpu", "webhooks")
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "paused-cpu"), workers=workers) as stack:
        redis = stack.services.redis
        image = png_bytes(64, 48)
        # The first fetch answers after 2 s (the worker is paused by then), the second at once.
        url = loopback_host.route("/m/paused.png", (200, {"Content-Type": "image/png"}, image, 2.0),
                                  (200, {"Content-Type": "image/png"}, image))
        job_id = stack.submit({"prompt": "<image> Describe it.", "content_parts": [{"type": "image_url", "url": url}],
                               "sampling_params": generation(300), "stream_events": True,
                               "webhook": {"url": stack.host.url(HOOK)}})["id"]
        wait_until(lambda: loopback_host.requests["/m/paused.png"], 30, "the first fetch")
        fetching = wait_until(lambda: next((name for name in ("cpu-a", "cpu-b")
                                            if (stack.heartbeat(name) or {}).get("held")), None), 10,
                              "the CPU worker that fetches")
        stack.pause(fetching)
        try:
            # The other CPU worker runs the job's message and its prompt reaches the GPU worker.
            wait_until(lambda: stack.services.jobs.get(job_id)["status"] == "generating", 30, "generation")
        finally:
            stack.resume(fetching)
        # The woken run finishes its fetch and processing, and finds it is not the newest.
        wait_until(lambda: not (stack.heartbeat(fetching) or {"held": [1]}).get("held"), 30, "the woken run's end")
        assert_one_attempts_tokens_everywhere(stack, [job_id])
        assert int(redis.get(preprocess_key(job_id))) >= 2  # the paused run, then the newest (more if a beat lapsed)
        assert int(redis.get(attempt_key(job_id))) == 1  # one generation: no generate sent by the late run
        assert [event.type for event in stack.services.events.all(job_id)].count("restart") == 0
