"""A killed GPU worker's jobs end soon after a restart, at the default visibility timeout (an hour)
and stall period (two minutes): its held messages go back to their queues once its heartbeat is
gone (workers/infra/held_messages.py), not when kombu's visibility timeout would give them back, and a
message it had popped but not yet recorded is sent again then too (workers/jobs/reaper.py), not
when the job has stalled."""

from __future__ import annotations

import base64
import json
import time

from tests.conftest import empty_db_url
from tests.e2e.conftest import build_stack, log_dir_for, make_stack_env
from workers.names import GENERATE_TASK, SHARED_GENERATE_QUEUE

MAX_TOKENS = 600  # each batch of 8 decodes for 600 steps: still running when the test sees it start
JOBS = [{"token_ids": [100 + i, 140, 150],
         "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}
        for i in range(20)]


def test_a_killed_gpu_workers_jobs_end_within_30_s_of_its_restart(redis_url, demo_model_dir, loopback_host,
                                                                 tmp_path_factory):
    env = make_stack_env(redis_url=empty_db_url(redis_url, 20), model_dir=demo_model_dir,
                         state_dir=tmp_path_factory.mktemp("death-state"), loopback=loopback_host,
                         ROLLOUT_VISIBILITY_TIMEOUT="3600", ROLLOUT_GPU_BATCH_SIZE="8")
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "gpu-death"), workers=("cpu", "gpu")) as stack:
        ids = [stack.submit(body)["id"] for body in JOBS]
        deadline = time.monotonic() + 60
        while not any(stack.services.jobs.get(job_id)["status"] == "generating" for job_id in ids):
            assert time.monotonic() < deadline, "no job started generating"
            time.sleep(0.05)
        # A batch decoding, the next one reserved: the kill comes at a state, not after a time,
        # so a faster machine cannot finish every job first.
        while stack.services.redis.hlen("unacked") <= 8:
            assert time.monotonic() < deadline, "the next batch was never reserved"
            time.sleep(0.01)
        stack.kill("gpu")  # kill -9: nothing acknowledged, nothing given back
        at_kill = [stack.services.jobs.get(job_id)["status"] for job_id in ids]
        assert "generating" in at_kill, at_kill
        stack.start("gpu")
        stack.wait_ready(["gpu"])
        restarted = time.monotonic()
        done = [stack.wait(job_id, timeout=max(1.0, 30 - (time.monotonic() - restarted))) for job_id in ids]
        assert [job["status"] for job in done] == ["succeeded"] * len(ids), [job["status"] for job in done]
        assert all(len(job["result"]["choices"][0]["token_ids"]) == MAX_TOKENS for job in done)
        ended_after = time.monotonic() - restarted
        print(f"every job ended {ended_after:.1f} s after the restart")
        assert ended_after < 30, ended_after


def test_a_message_a_killed_worker_popped_and_never_recorded_runs_soon_after_its_restart(
        redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    env = make_stack_env(redis_url=empty_db_url(redis_url, 20), model_dir=demo_model_dir,
                         state_dir=tmp_path_factory.mktemp("pop-state"), loopback=loopback_host)
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "gpu-pop"), workers=("cpu", "gpu")) as stack:
        stack.kill("gpu")
        ids = [stack.submit(body)["id"] for body in JOBS[:3]]
        # What a worker killed between kombu's BRPOP and its unacked record leaves: the oldest
        # message gone from its queue and held nowhere. (A busy worker is often in that window:
        # killed while it took messages, it lost one in three kills.)
        assert stack.services.redis.rpop(SHARED_GENERATE_QUEUE) is not None
        stack.start("gpu")
        stack.wait_ready(["gpu"])
        restarted = time.monotonic()
        done = [stack.wait(job_id, timeout=max(1.0, 30 - (time.monotonic() - restarted))) for job_id in ids]
        assert [job["status"] for job in done] == ["succeeded"] * len(ids)


def _held_generate_messages(redis_client) -> list[list]:
    """The args of every rollout.generate message a GPU worker holds unacknowledged."""
    held = []
    for raw in redis_client.hvals("unacked"):
        message = json.loads(raw)[0]  # [message, exchange, routing key]
        if message["headers"].get("task") == GENERATE_TASK:
            held.append(json.loads(base64.b64decode(message["body"]))[0])
    return held


def test_a_batch_chunk_is_one_message_acknowledged_by_its_last_job_and_redelivered_whole(
        redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    env = make_stack_env(redis_url=empty_db_url(redis_url, 20), model_dir=demo_model_dir,
                         state_dir=tmp_path_factory.mktemp("chunk-state"), loopback=loopback_host,
                         ROLLOUT_VISIBILITY_TIMEOUT="3600", ROLLOUT_GPU_BATCH_SIZE="8")
    most = {f"short{i}": 2 for i in range(3)} | {f"long{i}": MAX_TOKENS for i in range(3)}
    lines = "".join(json.dumps({"custom_id": custom_id, "kind": "generate", "body": {
        "token_ids": [100 + i, 140, 150], "sampling_params": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}}})
        + "\n" for i, (custom_id, tokens) in enumerate(most.items()))
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "gpu-chunk"),
                     workers=("cpu", "gpu", "batches")) as stack:
        response = stack.client.post("/v1/batches", data=lines, content_type="application/jsonl", headers=stack.headers())
        assert response.status_code == 202, response.get_json()
        batch_id = response.get_json()["id"]
        deadline = time.monotonic() + 60
        while len(job_ids := stack.services.batches.line_jobs(batch_id, list(range(1, 7)))) < 6:
            assert time.monotonic() < deadline, "the chunk's jobs were never made"
            time.sleep(0.05)
        short, long = [job_ids[n] for n in (1, 2, 3)], [job_ids[n] for n in (4, 5, 6)]
        for job_id in short:
            assert stack.wait(job_id)["status"] == "succeeded"
        # The short jobs ended, the long ones decode: the chunk's one message is still held.
        assert all(stack.services.jobs.get(job_id)["status"] == "generating" for job_id in long)
        assert [sorted(args[0]) for args in _held_generate_messages(stack.services.redis)] == [sorted(short + long)]
        stack.kill("gpu")
        stack.start("gpu")
        stack.wait_ready(["gpu"])
        ended = stack.client.get(f"/v1/batches/{batch_id}?wait=60", headers=stack.headers()).get_json()
        assert ended["status"] == "completed" and ended["request_counts"]["completed"] == 6, ended
        output = stack.client.get(f"/v1/batches/{batch_id}/output", headers=stack.headers()).get_data(as_text=True)
        tokens = {entry["custom_id"]: len(entry["response"]["body"]["choices"][0]["token_ids"])
                  for entry in map(json.loads, output.splitlines())}
        assert tokens == most
        # Redelivered whole, and acknowledged (on the worker's event loop, just after the ends) once all ended.
        deadline = time.monotonic() + 10
        while held := _held_generate_messages(stack.services.redis):
            assert time.monotonic() < deadline, held
            time.sleep(0.05)
