"""Per-token weight versions and the staleness bound in every dialect (#51 items 2 and 3): the
request's max_policy_lag is stored as ours from each dialect's sampling names, and each reply
carries the choice's weight_versions spans (SGLang's meta_info, vLLM's token-in-token-out choices)
and names a row ended for its lag. No workers here: tests/workers/gpu/test_update_modes_session.py
runs rows across updates."""

from __future__ import annotations

import pytest

from domain.jobs.follow import ChoiceDelta, TokenLedger
from tests.web.conftest import auth
from web.dialects.openai.stream import GenerateChunks
from web.dialects.sglang.request import job_replies
from web.dialects.vllm.request import generate_reply

SPANS = [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 3}]


def _job(finish_reason: str = "length") -> dict:
    choice = {"index": 0, "token_ids": [5, 6, 7], "logprobs": [-0.5, -1.0, -0.25], "finish_reason": finish_reason,
              "text": "abc", "weight_versions": SPANS, "kv_recomputed": False}
    return {"id": "job_x", "status": "succeeded", "created_at": 1.0, "completed_at": 2.0,
            "result": {"prompt_token_ids": [1, 2], "choices": [choice], "weight_version": "v2",
                       "usage": {"prompt_tokens": 2, "completion_tokens": 3}}}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/jobs", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "max_policy_lag": 1}}),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "max_policy_lag": 1}}),
    ("/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "max_policy_lag": 1}}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "max_policy_lag": 1}),
])
def test_max_policy_lag_is_stored_from_every_dialect(client, path, body):
    if "model" in body:
        body = {**body, "model": client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]}
    reply = client.post(path, json={**body, **({"stream": True} if path != "/v1/jobs" else {})}, headers=auth())
    assert reply.status_code in (200, 202), reply.get_data(as_text=True)[:500]
    store = client.application.extensions["rollout"].jobs
    [job] = client.get("/v1/jobs", headers=auth()).get_json()["data"]
    assert store.get(job["id"])["request"]["sampling_params"]["max_policy_lag"] == 1


@pytest.mark.parametrize("path", ["/v1/jobs", "/generate"])
def test_a_negative_lag_is_refused(client, path):
    body = {"token_ids": [1, 2], "sampling_params": {"max_policy_lag": -1}} if path == "/v1/jobs" else \
        {"input_ids": [1, 2], "sampling_params": {"max_policy_lag": -1}}
    reply = client.post(path, json=body, headers=auth())
    assert reply.status_code in (400, 422) and "max_policy_lag" in reply.get_data(as_text=True)


def test_sglang_meta_info_carries_the_spans_and_names_a_lagged_row():
    request = {"sampling_params": {"n": 1, "logprobs": False}}
    [reply] = job_replies(request, {}, _job(), None)
    assert reply["meta_info"]["weight_version"] == "v2" and reply["meta_info"]["weight_versions"] == SPANS
    [lagged] = job_replies(request, {}, _job("policy_lag"), None)
    assert lagged["meta_info"]["finish_reason"]["type"] == "abort"
    assert "policy_lag" in lagged["meta_info"]["finish_reason"]["message"]


def test_vllm_generate_choices_carry_the_spans():
    reply = generate_reply({"sampling_params": {}}, {"sampling_params": {"n": 1}}, _job("policy_lag"))
    [choice] = reply["choices"]
    assert choice["weight_versions"] == SPANS and choice["finish_reason"] == "policy_lag"
    assert reply["weight_version"] == "v2"


def test_vllm_generate_streams_the_spans_on_the_final_chunk(make_app):
    import json

    with make_app().test_request_context():
        chunks = GenerateChunks({"sampling_params": {}}, {"sampling_params": {"n": 1}})
        [final] = chunks.done(_job(), [ChoiceDelta("job_x", 0, finish_reason="length")], TokenLedger())
    [choice] = json.loads(final.decode().removeprefix("data: "))["choices"]
    assert choice["weight_versions"] == SPANS
