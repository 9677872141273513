"""A stream of a finished job holds about its stored result once, not its decoded objects
(issue #47 item 5: an 8 MB result held 49 MB per unread stream), and a dialect's stream holds its
last chunk's bytes, not the record they were made of. The streams are the app's own routes on a
real Redis (the Flask test client, the response read lazily as a WSGI server writes it), and what
they send is the bytes they always sent."""

from __future__ import annotations

import random
import struct
import tracemalloc

import pytest
import redis

from domain.jobs.view import public_job
from domain.settings import Settings
from tests.conftest import db_url
from tests.web.conftest import KEY_A, auth
from web.api.streams import sse
from web.app import create_app


@pytest.fixture(scope="module")
def client(redis_url, demo_model_dir, tmp_path_factory):
    """One app for the module (its model's facts probed once). A stream's first chunk, which the
    test client waits for, comes after a keep-alive period while its job is queued: a short one."""
    url = db_url(redis_url, 2)
    redis.Redis.from_url(url).flushdb()
    app = create_app(Settings(state_dir=tmp_path_factory.mktemp("stream-memory"), model=str(demo_model_dir),
                              api_keys=(KEY_A,), stream_keepalive_seconds=0.1), url)
    app.config["TESTING"] = True
    return app.test_client()


def _f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def large_result(tokens: int, top: int = 5) -> dict:
    """A generation result as the GPU worker stores one: float32 logprobs (half of them under 1e-4,
    as a confident model's are), ``top`` top logprobs a token, text past ASCII."""
    rnd = random.Random(tokens)
    logprobs = [_f32(-rnd.expovariate(1e4) if i % 2 else -rnd.expovariate(0.5)) for i in range(tokens)]
    return {"prompt_token_ids": list(range(100, 300)), "placeholder_ranges": [], "weight_version": "v1",
            "timings": {"decode_s": 1.5}, "transport": "inline",
            "choices": [{"index": 0, "token_ids": [rnd.randrange(150_000) for _ in range(tokens)], "logprobs": logprobs,
                         "finish_reason": "length", "matched_stop": None, "text": "résumé 😀 \x7f" * (tokens // 3),
                         "top_logprobs": [[[rnd.randrange(150_000), _f32(-rnd.expovariate(0.2))] for _ in range(top)]
                                          for _ in range(tokens)] if top else None}],
            "usage": {"prompt_tokens": 200, "completion_tokens": tokens}, "cached_tokens": 0}


def ended_job(client, result: dict) -> str:
    job = client.post("/v1/jobs", headers=auth(), json={"token_ids": [5], "sampling_params": {"max_tokens": 1}},
                      ).get_json()
    assert client.application.extensions["rollout"].jobs.advance(job["id"], "succeeded", result=result)
    return job["id"]


def open_stream(client, job_id: str):
    """A stream whose reader took its first piece of the result and reads no more: what the
    server holds for a client that stopped reading."""
    response = client.get(f"/v1/jobs/{job_id}/events", headers=auth(), buffered=False)
    assert response.status_code == 200
    pieces = iter(response.response)
    while b"event: result" not in next(pieces):
        pass
    return response


def test_unread_streams_of_large_results_hold_each_result_about_once(client, redis_client):
    result = large_result(40_000)
    shared, other = ended_job(client, result), ended_job(client, result)
    stored = len(redis_client.hget(f"rq:job:{shared}", "result"))
    assert stored > 4_000_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        streams = [open_stream(client, job_id) for job_id in (shared, shared, other)]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # Decoded, a result takes about five times its stored bytes, and each stream held its own: 14
    # times it for these three. Sent from the stored bytes, a result is held once per job, however
    # many streams send it.
    assert held < 2.5 * stored, (held / stored, stored)
    for response in streams:
        response.close()


def test_a_stream_sends_a_stored_result_as_it_always_did(client):
    """Byte for byte the message ``sse`` writes of the decoded job (json.dumps' spelling: ASCII
    only, Python's float repr), though the result is stored in orjson's."""
    job_id = ended_job(client, large_result(3_000))
    body = b"".join(client.get(f"/v1/jobs/{job_id}/events", headers=auth()).response)
    message = body[body.index(b"event: result"):]
    job = client.application.extensions["rollout"].jobs.get(job_id)
    assert message == sse(public_job(job), event="result")
    assert b"1e-05" in message or b"e-06" in message  # floats Python spells unlike orjson were there


@pytest.mark.parametrize("path, body", [
    ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}, "stream": True, "return_logprob": True}),
    ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"max_tokens": 1, "logprobs": 1}, "stream": True}),
])
def test_an_unread_dialect_stream_holds_its_last_chunk_not_the_record_it_was_made_of(client, redis_client, path, body):
    response = client.post(path, json=body, headers=auth(), buffered=False)
    assert response.status_code == 200
    job = client.get("/v1/jobs?limit=1", headers=auth()).get_json()["data"][0]  # the stream's own job, queued
    assert client.application.extensions["rollout"].jobs.advance(job["id"], "succeeded",
                                                                 result=large_result(20_000, top=0))
    stored = len(redis_client.hget(f"rq:job:{job['id']}", "result"))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        last = next(piece for piece in response.response if piece != b": keep-alive\n\n")
        held = tracemalloc.get_traced_memory()[0] - before - len(last)
    finally:
        tracemalloc.stop()
    assert b'"job_id"' in last and len(last) > stored  # the job's last chunk: its every token and logprob
    # The decoded record it was made of (three times the stored result here) is gone.
    assert held < stored / 2, (held / stored, stored)
    response.close()
