"""``GET /v1/jobs/{id}`` sends a stored result from its bytes (web/api/job_reply.py): the reply is
the job as it always was (its masks as CSR lists though they are stored packed), and one GET of a
large result holds about its stored bytes, never its decoded objects (#56: +1 GB in the API
process for one GET of a 190 MB record)."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from domain.jobs.results import readable_result
from domain.jobs.view import public_job
from engine.sampling_mask import SamplingMasks
from tests.web.api.test_stream_memory import client, ended_job, large_result  # noqa: F401 (client: a fixture)
from tests.web.conftest import auth
from web.api.schemas import JobSchema


def masked(result: dict, steps: int, support: int) -> dict:
    """``result`` with a packed sampling mask of ``support`` ids a token on its choice."""
    masks = SamplingMasks()
    rng = np.random.default_rng(steps)
    for _ in range(steps):
        masks.add(np.sort(rng.choice(150_000, support, replace=False)).astype(np.int32))
    result["choices"][0]["sampling_mask"] = masks.packed()
    return result


@pytest.mark.parametrize("tokens", [200, 30_000])  # one body, and pieces
def test_the_reply_is_the_job_as_it_always_was(client, tokens):  # noqa: F811
    result = masked(large_result(tokens), tokens, 4)
    job_id = ended_job(client, result)
    reply = client.get(f"/v1/jobs/{job_id}", headers=auth())
    assert reply.status_code == 200 and reply.mimetype == "application/json"
    assert (reply.content_length is not None) == (tokens == 200)
    job = client.application.extensions["rollout"].jobs.get(job_id)  # decoded: its masks as lists
    expected = JobSchema().dump(public_job(job))
    assert reply.get_json() == json.loads(json.dumps(expected))
    assert reply.get_json()["result"] == json.loads(json.dumps(readable_result(result)))
    mask = reply.get_json()["result"]["choices"][0]["sampling_mask"]
    assert len(mask["offsets"]) == tokens + 1 and len(mask["token_ids"]) == 4 * tokens


def test_a_job_without_a_result_is_answered_as_before(client):  # noqa: F811
    job = client.post("/v1/jobs", headers=auth(), json={"token_ids": [5], "sampling_params": {"max_tokens": 1}})
    reply = client.get(f"/v1/jobs/{job.get_json()['id']}", headers=auth()).get_json()
    assert reply["status"] == "queued" and reply["result"] is None and reply["object"] == "job"


def test_one_get_of_a_large_result_holds_about_its_stored_bytes(client, redis_client):  # noqa: F811
    job_id = ended_job(client, masked(large_result(40_000), 40_000, 8))
    stored = len(redis_client.hget(f"rq:job:{job_id}", "result"))
    assert stored > 4_000_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        response = client.get(f"/v1/jobs/{job_id}", headers=auth(), buffered=False)
        sent = 0
        for piece in response.response:  # as a server writes it: a piece at a time
            sent += len(piece)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    response.close()
    assert sent > stored
    # Decoded, the record took about six times its stored bytes (the masks' lists more again).
    assert peak < 2 * stored, (peak / stored, stored)
