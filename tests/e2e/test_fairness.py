"""One key cannot stall another: slow media, hanging webhook receivers and slow renders of key A
leave room for key B's work (issue 14, item 3; at the CPU defaults of a two-core machine, issue
#47), and /v1/render keeps the configured limits.

Real slow servers on loopback (the shared loopback host answers a route after a delay), real CPU
and webhook workers with the default per-key shares. Each test first waits until A's slow work
holds its share of the worker, then times B.
"""

from __future__ import annotations

import base64
import io
import threading
import time

import pytest
from PIL import Image

from domain.infra.fair_share import KeyShare
from tests.conftest import empty_db_url
from tests.e2e.conftest import API_KEY, OTHER_KEY, build_stack, log_dir_for, make_stack_env
from web.auth import key_id
from workers.celery_app import PREPROCESS_QUEUE

SLOW_MEDIA_S = 15.0  # under the stack's media deadline: A's jobs are slow, not failing
HANG_S = 25.0  # past the webhook deadline: each of A's attempts holds a thread for the whole of it
B_WITHIN_S = 5.0


def png(size=(32, 24), color=(40, 120, 200)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


@pytest.fixture(scope="module")
def fair(redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    env = make_stack_env(
        redis_url=empty_db_url(redis_url, 12), model_dir=demo_model_dir,
        state_dir=tmp_path_factory.mktemp("fair-state"), loopback=loopback_host, node_id="fair-node",
        ROLLOUT_FETCH_TIMEOUT="20", ROLLOUT_FETCH_RETRIES="0",
        # The defaults on two cores: two preprocessing slots, a key's share half of them.
        ROLLOUT_CPU_CONCURRENCY="2",
        ROLLOUT_WEBHOOK_TIMEOUT="20", ROLLOUT_WEBHOOK_RETRY_SCHEDULE="60",
        # Fewer threads than A has hanging receivers: only the per-key share lets B through.
        ROLLOUT_WEBHOOK_CONCURRENCY="16",
        ROLLOUT_RENDER_PER_KEY="2",
        # Limits /v1/render must apply (it used its own defaults: 32 parts, 16M pixels, 32768 tokens).
        ROLLOUT_MAX_CONTENT_PARTS="4", ROLLOUT_MAX_IMAGE_PIXELS="1000", ROLLOUT_MAX_MODEL_LEN="200",
    )
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "fair"), workers=("cpu", "webhooks")) as stack:
        yield stack


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def status(stack, job_id: str) -> str:
    return stack.services.jobs.get(job_id)["status"]


def test_a_keys_slow_media_leave_room_for_another_keys_job(fair):
    host = fair.host
    slow = [host.route(f"/fair/slow-{i}.png", (200, {"Content-Type": "image/png"}, png(), SLOW_MEDIA_S))
            for i in range(4)]
    a_jobs = [fair.submit({"prompt": "<image>" * 4 + "Describe.", "sampling_params": {"max_tokens": 2},
                           "content_parts": [{"type": "image_url", "url": url} for url in slow]})["id"]
              for _ in range(16)]
    try:
        # A's slow jobs hold A's share of the CPU worker; the rest of A's 16 wait.
        wait_for(lambda: sum(status(fair, j) == "preprocessing" for j in a_jobs) >= 1, 30, "A's jobs starting")
        fast = host.route("/fair/b.png", (200, {"Content-Type": "image/png"}, png(color=(9, 9, 9))))
        started = time.monotonic()
        b_job = fair.submit({"prompt": "<image>Describe.", "sampling_params": {"max_tokens": 2},
                             "content_parts": [{"type": "image_url", "url": fast}]}, key=OTHER_KEY)["id"]
        wait_for(lambda: status(fair, b_job) != "queued", 30, "B's job starting")
        waited = time.monotonic() - started
        assert waited < B_WITHIN_S, f"B's one-image job waited {waited:.1f} s behind A's slow media"
        assert sum(status(fair, j) == "preprocessing" for j in a_jobs) <= 1, "A held more than its share"
        # A's other jobs wait parked, not cycling through the queue or the worker's memory.
        owner = fair.services.jobs.get(a_jobs[0])["owner"]
        assert KeyShare(fair.services.redis, "cpu", per_key=1, lease_s=1).parked(owner) >= 12
        assert fair.services.redis.llen(PREPROCESS_QUEUE) == 0
    finally:
        for job_id in a_jobs:
            fair.client.delete(f"/v1/jobs/{job_id}", headers=fair.headers())


def test_a_keys_hanging_receivers_leave_room_for_another_keys_webhook(fair):
    host = fair.host
    text = {"token_ids": [100, 101, 102], "sampling_params": {"max_tokens": 2}}  # never generated: no GPU worker
    a_jobs = [fair.submit({**text, "webhook": {"url": host.route(f"/fair/hang-{i}", (200, {}, b"", HANG_S))}})["id"]
              for i in range(24)]
    for job_id in a_jobs:  # a cancelled job's webhook is due at once
        assert fair.client.delete(f"/v1/jobs/{job_id}", headers=fair.headers()).status_code == 200
    # A's share of the webhook worker's threads hangs on A's receivers.
    wait_for(lambda: sum(bool(host.requests[f"/fair/hang-{i}"]) for i in range(24)) >= 8, 30,
             "A's deliveries starting")
    b_hook = host.route("/fair/b-hook", (200, {}, b""))
    b_job = fair.submit({**text, "webhook": {"url": b_hook}}, key=OTHER_KEY)["id"]
    started = time.monotonic()
    assert fair.client.delete(f"/v1/jobs/{b_job}", headers=fair.headers(OTHER_KEY)).status_code == 200
    wait_for(lambda: host.requests["/fair/b-hook"], 30, "B's webhook delivery")
    waited = time.monotonic() - started
    assert waited < B_WITHIN_S, f"B's webhook waited {waited:.1f} s behind A's hanging receivers"


def messages(*urls: str, text: str = "What is this?") -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def test_render_uses_the_configured_limits(fair):
    def render(body):
        return fair.client.post("/v1/render", json={"messages": body}, headers=fair.headers())

    small = data_url(png())
    ok = render(messages(small))
    assert ok.status_code == 200, ok.get_json()
    too_many = render(messages(*[small] * 5))
    assert (too_many.status_code, too_many.get_json().get("code")) == (422, "too_many_content_parts")
    too_big = render(messages(data_url(png(size=(64, 48)))))  # 3,072 pixels, over ROLLOUT_MAX_IMAGE_PIXELS
    assert (too_big.status_code, too_big.get_json().get("code")) == (422, "media_too_large"), too_big.get_json()
    too_long = render(messages(small, text="many words " * 300))
    assert (too_long.status_code, too_long.get_json().get("code")) == (422, "context_length_exceeded")


def test_a_keys_slow_renders_hold_only_its_share(fair):
    slow = fair.host.route("/fair/render-slow.png", (200, {"Content-Type": "image/png"}, png(), 6.0))
    answers = []

    def slow_render():
        answers.append(fair.app.test_client().post("/v1/render", json={"messages": messages(slow)},
                                                   headers=fair.headers()).status_code)

    threads = [threading.Thread(target=slow_render) for _ in range(2)]
    for thread in threads:
        thread.start()
    # Both of A's renders wait in the API (one fetching, the other parked behind A's CPU share).
    api_renders = KeyShare(fair.services.redis, "api-render", per_key=2, lease_s=1)
    wait_for(lambda: api_renders.held(key_id(API_KEY)) >= 2 and fair.host.requests["/fair/render-slow.png"], 20,
             "A's renders waiting")
    third = fair.client.post("/v1/render", json={"messages": messages(slow)}, headers=fair.headers())
    assert (third.status_code, third.get_json().get("code")) == (429, "too_many_renders")
    assert third.headers["Retry-After"]
    started = time.monotonic()
    b = fair.client.post("/v1/render", json={"messages": messages(data_url(png()))}, headers=fair.headers(OTHER_KEY))
    assert b.status_code == 200, b.get_json()
    assert time.monotonic() - started < B_WITHIN_S
    for thread in threads:
        thread.join()
    assert answers == [200, 200]
