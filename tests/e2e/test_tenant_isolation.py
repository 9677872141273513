"""Isolation between API keys on the shared stack: key A (``API_KEY``) and key B (``OTHER_KEY``).

The multimodal cache: an entry found by a content part's ``uuid`` belongs to the key that made it.
Key B, knowing A's uuid, can neither read A's entry (sending a dead URL with it) nor plant its own
image under it for A's later job, through ``/v1/jobs``, ``/generate``, ``/v1/render`` and batch
lines. Media comes from the loopback host, so each test sees exactly which URLs were fetched.

GPU batches: a bad row of one key (token ids outside the vocabulary, or anything else that makes
the engine raise) fails its own job only; the other key's jobs in the batch complete (that their
results equal those they get alone, in batches made exactly so: tests/workers/gpu/test_isolation.py).
"""

from __future__ import annotations

import io
import json
import signal
import time
import uuid
from dataclasses import dataclass

import pytest
from PIL import Image

from processors.fetch import GuardedFetcher
from processors.registry import load_processor
from tests.e2e.conftest import API_KEY, OTHER_KEY
from tests.workers.bad_rows import plant_job, plant_mismatched_image_job
from web.auth import key_id
from workers.runtimes import fetch_policy

GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
PNG = {"Content-Type": "image/png"}
# The demo model's image placeholder runs: 64x48 -> 4 tokens, 112x84 -> 12 tokens.
SIZE_A, SIZE_B = (64, 48), (112, 84)


def png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


class Media:
    """A's image, B's image and a dead URL on the loopback host, under paths of their own."""

    def __init__(self, host):
        self.host = host
        prefix = f"/isolation/{uuid.uuid4().hex}"
        self.a = host.route(f"{prefix}/a.png", (200, PNG, png(SIZE_A, (200, 30, 30))))
        self.b = host.route(f"{prefix}/b.png", (200, PNG, png(SIZE_B, (30, 30, 200))))
        self.dead = host.route(f"{prefix}/gone.png", (404, {}, b""))

    def fetches(self, url: str) -> int:
        return len(self.host.requests[url[url.index("/isolation/"):]])


@pytest.fixture
def media(stack):
    return Media(stack.host)


def new_uuid() -> str:
    return f"sample-{uuid.uuid4().hex[:8]}"  # dataset-style: the kind of id another key can guess


def image_job(url: str, part_uuid: str) -> dict:
    return {"prompt": "<image>Describe it.", "sampling_params": GREEDY,
            "content_parts": [{"type": "image_url", "url": url, "uuid": part_uuid}]}


@dataclass
class Outcome:
    ok: bool
    code: str | None  # the error code when not ok
    used: object = None  # what the image made of the result (token ids, choices) when ok


def via_jobs(stack, url: str, part_uuid: str, key: str) -> Outcome:
    job = stack.wait(stack.submit(image_job(url, part_uuid), key=key)["id"], key=key)
    if job["status"] != "succeeded":
        return Outcome(False, job["error"]["code"])
    return Outcome(True, None, (job["result"]["prompt_token_ids"], job["result"]["choices"]))


def via_generate(stack, url: str, part_uuid: str, key: str) -> Outcome:
    response = stack.client.post("/v1/generate", json=image_job(url, part_uuid), headers=stack.headers(key))
    body = response.get_json()
    if response.status_code != 200:
        assert response.status_code == 422, body
        return Outcome(False, body["code"])
    return Outcome(True, None, (body["prompt_token_ids"], body["choices"]))


def via_render(stack, url: str, part_uuid: str, key: str) -> Outcome:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}, "uuid": part_uuid},
                                             {"type": "text", "text": "Describe it."}]}]
    response = stack.client.post("/v1/render", json={"messages": messages}, headers=stack.headers(key))
    body = response.get_json()
    if response.status_code != 200:
        assert response.status_code == 422, body
        return Outcome(False, body["code"])
    return Outcome(True, None, body["token_ids"])


def via_batch_line(stack, url: str, part_uuid: str, key: str, timeout: float = 60.0) -> Outcome:
    line = json.dumps({"custom_id": "only", "kind": "generate", "body": image_job(url, part_uuid)})
    response = stack.client.post("/v1/batches", data=line,
                                 headers={**stack.headers(key), "Content-Type": "application/jsonl"})
    assert response.status_code == 202, response.get_json()
    batch_id = response.get_json()["id"]
    deadline = time.monotonic() + timeout
    while (batch := stack.client.get(f"/v1/batches/{batch_id}", headers=stack.headers(key)).get_json())["status"] \
            not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch {batch_id} did not end in {timeout} s: {batch}"
        time.sleep(0.05)
    if batch["request_counts"]["failed"]:
        [error] = batch_lines(stack, batch_id, "errors", key)
        return Outcome(False, error["error"]["code"])
    [output] = batch_lines(stack, batch_id, "output", key)
    body = output["response"]["body"]
    return Outcome(True, None, (body["prompt_token_ids"], body["choices"]))


def batch_lines(stack, batch_id: str, which: str, key: str) -> list[dict]:
    text = stack.client.get(f"/v1/batches/{batch_id}/{which}", headers=stack.headers(key)).get_data(as_text=True)
    return [json.loads(line) for line in text.splitlines()]


SURFACES = {"jobs": via_jobs, "generate": via_generate, "render": via_render, "batch_line": via_batch_line}


@pytest.mark.parametrize("surface", SURFACES)
def test_another_key_cannot_read_an_entry_by_its_uuid(stack, media, surface):
    run = SURFACES[surface]
    secret = new_uuid()
    original = run(stack, media.a, secret, API_KEY)
    assert original.ok, original
    # A's own entry serves A with a dead URL: the cache is in use...
    assert run(stack, media.dead, secret, API_KEY) == original
    # ...but never B: B's request fetches the dead URL and fails exactly as with a uuid nobody used
    # (so /v1/render does not tell B whether A uses the uuid either).
    stolen, unused = run(stack, media.dead, secret, OTHER_KEY), run(stack, media.dead, new_uuid(), OTHER_KEY)
    assert stolen == unused == Outcome(False, "media_rejected"), (stolen, unused)
    assert media.fetches(media.dead) == 2


@pytest.mark.parametrize("surface", SURFACES)
def test_another_key_cannot_plant_an_entry_under_a_uuid(stack, media, surface):
    run = SURFACES[surface]
    reference = run(stack, media.a, new_uuid(), API_KEY)
    planted_uuid = new_uuid()
    planted = run(stack, media.b, planted_uuid, OTHER_KEY)  # B's image first, under the uuid A will use
    assert reference.ok and planted.ok and planted.used != reference.used, (reference, planted)
    mine = run(stack, media.a, planted_uuid, API_KEY)
    assert mine == reference  # A's own image, fetched from A's URL, never B's entry
    assert media.fetches(media.a) == 2


# --- One key's bad rows in a GPU batch ------------------------------------------------------------

def test_bad_rows_of_one_key_never_fail_another_keys_jobs_in_their_batch(stack, media):
    """Key A's rows that pass no check but the engine's (ids outside the vocabulary) or none at all
    (a prompt whose image does not fit) share GPU batches with key B's jobs: only A's jobs fail."""
    svc = stack.services
    vocab, owner = svc.model_facts.vocab_size, key_id(API_KEY)

    def plant(**request):
        return plant_job(svc.jobs, svc.celery, svc.model_facts, owner, **request)

    good = [{"token_ids": [100 + n, 110, 120], "sampling_params": GREEDY} for n in range(3)] + [
        {"kind": "score", "token_ids": [100 + n, 101, 102], "completion_token_ids": [110 + n, 111, 112]}
        for n in range(3)]
    processor = load_processor(svc.model_path, model_id=svc.model_id)  # as the CPU worker plants jobs
    gpu = stack.workers["gpu"]
    gpu.send_signal(signal.SIGSTOP)  # everything waits in the queue, then shares batches
    try:
        mine = [stack.submit(body, key=OTHER_KEY)["id"] for body in good[:2]]
        bad = {"score": [plant(kind="score", token_ids=[100, 101], completion_token_ids=[110, vocab + 7]),
                         plant(kind="score", token_ids=[100, 101], completion_token_ids=[vocab])],
               "prompt": [plant(token_ids=[100, vocab + 1000, 102])],
               "untyped": [plant_mismatched_image_job(svc.jobs, svc.celery, owner, processor=processor,
                                                      fetcher=GuardedFetcher(fetch_policy(svc.settings)),
                                                      image_url=media.a)]}
        mine += [stack.submit(body, key=OTHER_KEY)["id"] for body in good[2:]]
    finally:
        gpu.send_signal(signal.SIGCONT)
    done = [stack.wait(job_id, key=OTHER_KEY) for job_id in mine]
    assert [job["status"] for job in done] == ["succeeded"] * len(good), [job.get("error") for job in done]
    for kind in ("score", "prompt"):
        for job_id in bad[kind]:
            failed = stack.wait(job_id)
            assert failed["status"] == "failed" and failed["error"]["code"] == "token_id_out_of_range", failed
    untyped = stack.wait(bad["untyped"][0])
    assert untyped["status"] == "failed" and untyped["error"]["code"] == "internal_error", untyped
    assert "mismatch" not in untyped["error"]["message"]  # the exception's text stays in the log

