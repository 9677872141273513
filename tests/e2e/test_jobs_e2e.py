"""Jobs through the whole stack: API → CPU worker → GPU worker → Redis, on the tiny demo model."""

from __future__ import annotations

import base64
import io
import signal
import time

from PIL import Image

from tests.e2e.conftest import OTHER_KEY
from tests.e2e.job_checks import wait_until


def image_data_url(width=64, height=48, color=(200, 30, 30)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_submit_poll_result(stack):
    job = stack.submit({"prompt": "Describe the image.", "sampling_params": GREEDY, "request_id": "r-1"})
    done = stack.wait(job["id"])
    assert done["status"] == "succeeded", done
    result = done["result"]
    choice = result["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]) == 6 and all(lp <= 0 for lp in choice["logprobs"])
    assert result["usage"]["completion_tokens"] == 6
    assert result["weight_version"] and done["request_id"] == "r-1"
    assert done["started_at"] >= done["created_at"] and done["completed_at"] >= done["started_at"]
    assert stack.client.get(f"/v1/jobs/{job['id']}", headers=stack.headers(OTHER_KEY)).status_code == 404


def test_image_job_expands_placeholders_once(stack):
    body = {"prompt": "<image>What colour?", "content_parts": [{"type": "image_url", "url": image_data_url()}],
            "sampling_params": GREEDY}
    done = stack.wait(stack.submit(body)["id"])
    assert done["status"] == "succeeded", done
    ranges = done["result"]["placeholder_ranges"]
    assert len(ranges) == 1 and ranges[0]["length"] == 4  # a 64x48 image is 4 tokens on the demo model
    assert done["result"]["transport"] in ("shm", "inline")


def test_same_seed_same_tokens_and_score_agrees(stack):
    body = {"token_ids": [100, 101, 102, 103], "sampling_params": {"max_tokens": 5, "temperature": 0.9, "seed": 7,
                                                           "ignore_eos": True}}
    first = stack.wait(stack.submit(body)["id"])["result"]["choices"][0]
    second = stack.wait(stack.submit(body)["id"])["result"]["choices"][0]
    assert first["token_ids"] == second["token_ids"]
    greedy = stack.wait(stack.submit({"token_ids": [100, 101, 102, 103], "sampling_params": GREEDY})["id"])
    tokens = greedy["result"]["choices"][0]["token_ids"]
    scored = stack.wait(stack.submit({"kind": "score", "token_ids": [100, 101, 102, 103],
                                      "completion_token_ids": tokens})["id"])
    assert scored["status"] == "succeeded", scored
    for a, b in zip(scored["result"]["completion_logprobs"], greedy["result"]["choices"][0]["logprobs"], strict=True):
        assert abs(a - b) < 1e-4


def test_media_error_fails_the_job_with_its_code(stack):
    body = {"prompt": "<image>x", "content_parts": [{"type": "image_url", "url": "http://169.254.169.254/latest"}],
            "sampling_params": GREEDY}
    done = stack.wait(stack.submit(body)["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "media_blocked"
    assert "169.254" not in done["error"]["message"] or "content_parts[0]" in done["error"]["message"]


def test_placeholder_mismatch_is_a_clear_failure(stack):
    body = {"prompt": "<image><image>two", "content_parts": [{"type": "image_url", "url": image_data_url()}],
            "sampling_params": GREEDY}
    done = stack.wait(stack.submit(body)["id"])
    assert done["status"] == "failed" and done["error"]["code"] == "placeholder_mismatch", done


def test_sync_generate_and_timeout(stack):
    response = stack.client.post("/v1/generate", json={"token_ids": [103, 104, 105], "request_id": "abc",
                                                       "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                           "ignore_eos": True}},
                                 headers=stack.headers())
    assert response.status_code == 200, response.get_json()
    body = response.get_json()
    assert body["request_id"] == "abc" and len(body["choices"][0]["token_ids"]) == 3
    assert body["prompt_token_ids"] == [103, 104, 105]
    slow = stack.client.post("/v1/generate", json={"token_ids": [103, 104, 105], "timeout": 0,
                                                   "sampling_params": {"max_tokens": 3}}, headers=stack.headers())
    assert slow.status_code == 202 and slow.headers["Location"].startswith("/v1/jobs/")


def test_cancel_while_generating_aborts_with_tokens_so_far(stack):
    body = {"token_ids": [101, 102, 103], "stream_events": True,  # its tokens are written as they come
            "sampling_params": {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}}
    job = stack.submit(body)
    deadline = time.monotonic() + 30
    # Cancelled once it made tokens (a state, not a time: 4,000 steps outlast it on any machine).
    while not any(event.type == "tokens" for event in stack.services.events.all(job["id"])):
        assert time.monotonic() < deadline, "no tokens came"
        time.sleep(0.01)
    stack.client.delete(f"/v1/jobs/{job['id']}", headers=stack.headers())
    done = stack.wait(job["id"])
    assert done["status"] == "cancelled"
    choice = done["result"]["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 4000
    assert len(choice["logprobs"]) == len(choice["token_ids"])


def test_render_then_generate_matches_generating_from_the_prompt(stack):
    url = image_data_url(color=(10, 120, 240))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What colour is this?"}]}]
    rendered = stack.client.post("/v1/render", json={"messages": messages}, headers=stack.headers())
    assert rendered.status_code == 200, rendered.get_json()
    rendered = rendered.get_json()
    assert len(rendered["content_parts"]) == 1
    from_ids = stack.wait(stack.submit({"token_ids": rendered["token_ids"], "content_parts": rendered["content_parts"],
                                        "sampling_params": GREEDY})["id"])
    from transformers import AutoTokenizer

    # The API no longer loads the processor (a CPU worker renders): read the template here.
    template = AutoTokenizer.from_pretrained(stack.services.model_path).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}],
        tokenize=False, add_generation_prompt=True)
    from_text = stack.wait(stack.submit({"prompt": template, "content_parts": rendered["content_parts"],
                                         "sampling_params": GREEDY})["id"])
    assert from_ids["status"] == from_text["status"] == "succeeded"
    assert from_ids["result"]["prompt_token_ids"] == rendered["token_ids"]
    assert from_ids["result"]["choices"][0]["token_ids"] == from_text["result"]["choices"][0]["token_ids"]
    assert stack.client.post("/v1/render", json={"messages": []}, headers=stack.headers()).status_code == 422
    bad = stack.client.post("/v1/render", json={"messages": [{"content": "no role"}]}, headers=stack.headers())
    assert bad.status_code == 422 and bad.get_json()["code"] == "invalid_request"


def test_healthz_and_metrics_reflect_the_running_stack(stack):
    # An image of its own (a colour no other test sends): a preprocess stage and a media cache miss.
    body = {"prompt": "<image>What colour?", "content_parts": [{"type": "image_url", "url": image_data_url(
        color=(3, 141, 59))}], "sampling_params": GREEDY}
    done = stack.wait(stack.submit(body)["id"])
    assert done["status"] == "succeeded"
    health = stack.client.get("/healthz")
    assert health.status_code == 200
    body = health.get_json()
    memory = body.pop("redis_memory")  # the stack's Redis is the tests' own, with no maxmemory
    assert memory["state"] == "unbounded" and memory["used_bytes"] > 0
    assert body == {"status": "ok", "redis": "up", "model": "up",
                    "workers": {"cpu": "up", "gpu": "up", "webhooks": "up", "batches": "up"}}
    text = wait_until(lambda: metrics_with(stack, 'rollout_jobs_ended_total{status="succeeded"}'), 5, "the job's end")
    assert 'rollout_queue_depth{queue="preprocess"}' in text
    assert 'rollout_stage_seconds_count{stage="generate"}' in text
    assert 'rollout_stage_seconds_count{stage="preprocess"}' in text
    assert 'rollout_events_total{event="mm_cache_miss"}' in text


def metrics_with(stack, line: str) -> str | None:
    """``GET /metrics``'s text once it holds ``line``: the GPU worker writes its jobs' ends with its
    other metrics, within a second (``domain.infra.metrics.MetricsBatch``)."""
    text = stack.client.get("/metrics").get_data(as_text=True)
    return text if line in text else None


def test_plain_token_prompts_skip_preprocessing_but_media_tokens_do_not(stack):
    plain = stack.wait(stack.submit({"token_ids": [100, 101], "sampling_params": GREEDY})["id"])
    assert plain["status"] == "succeeded" and plain["result"]["timings"]["preprocess"] == 0.0
    from transformers import AutoTokenizer

    media_id = AutoTokenizer.from_pretrained(stack.services.model_path).convert_tokens_to_ids("<|image_pad|>")
    assert media_id in stack.services.model_facts.media_token_ids
    # A placeholder with no media is refused before queueing (it failed in a worker once).
    stray = stack.client.post("/v1/jobs", json={"token_ids": [100, media_id, 101], "sampling_params": GREEDY},
                              headers=stack.headers())
    assert stray.status_code == 422 and stray.get_json()["code"] == "placeholder_mismatch", stray.get_json()
    vocab = stack.services.model_facts.vocab_size
    outside = stack.client.post("/v1/jobs", json={"token_ids": [100, vocab + 5], "sampling_params": GREEDY},
                                headers=stack.headers())
    assert outside.status_code == 422 and outside.get_json()["code"] == "token_id_out_of_range", outside.get_json()


def test_jobs_waiting_together_run_as_one_batch_and_a_lone_job_is_not_held(stack):
    """The GPU worker's flush rule (workers/tasks/gpu_batching.py): jobs that wait in the queue when the
    worker reads them become one batch; a job alone goes at once, without waiting for company."""
    gpu = stack.workers["gpu"]
    bodies = [{"token_ids": [100 + i, 110, 120], "sampling_params": GREEDY} for i in range(6)]
    gpu.send_signal(signal.SIGSTOP)  # the jobs pile up in the queue meanwhile
    try:
        ids = [stack.submit(body)["id"] for body in bodies]
    finally:
        gpu.send_signal(signal.SIGCONT)
    done = [stack.wait(job_id) for job_id in ids]
    assert [job["result"]["timings"]["batch_size"] for job in done] == [6] * 6, done
    alone = stack.wait(stack.submit(bodies[0])["id"])
    assert alone["result"]["timings"]["batch_size"] == 1
    batched, single = done[0]["result"]["choices"][0], alone["result"]["choices"][0]
    assert single["token_ids"] == batched["token_ids"]  # batched or alone, the same tokens
    assert all(abs(a - b) < 1e-5 for a, b in zip(single["logprobs"], batched["logprobs"], strict=True))
    # From queued to generating: well under a second (held at most ROLLOUT_GPU_BATCH_WAIT_MS, 5 ms here).
    assert alone["result"]["timings"]["queue_s"] < 0.5


def test_a_job_joins_the_running_batch_and_a_prompt_group_shares_its_prefill(stack):
    """Continuous batching through the GPU worker: a job submitted while a long one decodes runs
    beside it and ends first; jobs with the same prompt compute it once (cached_tokens); a cancel
    mid-batch ends that job only."""
    long = stack.submit({"token_ids": [100, 101, 102, 103], "sampling_params": {**GREEDY, "max_tokens": 3000}})
    deadline = time.monotonic() + 30
    while stack.services.jobs.get(long["id"])["status"] != "generating":
        assert time.monotonic() < deadline, "the long job never started"
        time.sleep(0.02)
    group = [stack.submit({"token_ids": [120, 121, 122, 123, 124], "sampling_params": {**GREEDY, "seed": s,
                                                                                        "temperature": 1.0}})
             for s in range(3)]
    done = [stack.wait(job["id"]) for job in group]
    assert stack.services.jobs.get(long["id"])["status"] == "generating"  # still decoding beside them
    assert all(job["status"] == "succeeded" for job in done), done
    assert sorted(job["result"]["cached_tokens"] for job in done) == [0, 5, 5]
    assert all(job["result"]["timings"]["batch_size"] >= 2 for job in done)
    stack.client.delete(f"/v1/jobs/{long['id']}", headers=stack.headers())
    cancelled = stack.wait(long["id"])
    assert cancelled["status"] == "cancelled"
    assert 0 < len(cancelled["result"]["choices"][0]["token_ids"]) < 3000
