"""Sampling masks, logprobs_mode and vLLM's prompt fields in each dialect (#51 items 4 and 5): the
request names map onto the native knobs (checked on the stored job), bad values are a 422 in the
dialect's shape, and each reply shape carries the mask as its dialect spells it. No workers here
(a sync call times out at once, its job kept); tests/e2e/test_sampling_mask_e2e.py runs the engine."""

from __future__ import annotations

import pytest

from tests.web.conftest import auth
from web.dialects.openai.chat import chat_reply
from web.dialects.openai.completions import completion_reply
from web.dialects.sglang.request import job_replies, sampling_mask_rows
from web.dialects.vllm.request import generate_reply

MASK = {"token_ids": [5, 7, 9, 7], "offsets": [0, 3, 4]}  # token 0 from {5, 7, 9}, token 1 from {7}
IMAGE = [{"modality": "image", "offset": 1, "length": 4}]


@pytest.fixture
def app(make_app):
    return make_app(sync_timeout_max=0.2)


@pytest.fixture
def client(app):
    return app.test_client()


def _stored(client) -> dict:
    (job,) = client.get("/v1/jobs", headers=auth()).get_json()["data"]
    return client.application.extensions["rollout"].jobs.get(job["id"])["request"]["sampling_params"]


@pytest.fixture
def model(client):
    return client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]


def test_vllm_generate_names(client):
    body = {"token_ids": [10, 11], "sampling_params": {"max_tokens": 2, "top_k": 5, "return_sampling_mask": True,
                                                       "logprobs_mode": "processed_logprobs"},
            "return_token_ids": True}
    assert client.post("/inference/v1/generate", json=body, headers=auth()).status_code == 504
    params = _stored(client)
    assert params["sampling_mask"] is True and params["logprobs_mode"] == "processed"


@pytest.mark.parametrize("mode, ours", [("raw_logprobs", "raw"), ("processed_logprobs", "processed")])
def test_openai_completions_names(client, model, mode, ours):
    body = {"model": model, "prompt": [10, 11], "max_tokens": 2, "top_p": 0.9, "return_sampling_mask": True,
            "logprobs_mode": mode}
    assert client.post("/v1/completions", json=body, headers=auth()).status_code == 504
    params = _stored(client)
    assert params["sampling_mask"] is True and params["logprobs_mode"] == ours


def test_openai_chat_names(client, model):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_k": 3,
            "return_sampling_mask": True, "logprobs_mode": "processed_logprobs"}
    assert client.post("/v1/chat/completions", json=body, headers=auth()).status_code == 504
    params = _stored(client)
    assert params["sampling_mask"] is True and params["logprobs_mode"] == "processed"


def test_sglang_names(client):
    body = {"input_ids": [10, 11], "return_sampling_mask": True,
            "sampling_params": {"max_new_tokens": 2, "top_k": 5, "logprobs_mode": "processed"}}
    assert client.post("/generate", json=body, headers=auth()).status_code == 504
    params = _stored(client)
    assert params["sampling_mask"] is True and params["logprobs_mode"] == "processed"


@pytest.mark.parametrize("path, body, field", [
    ("/inference/v1/generate", {"token_ids": [10], "sampling_params": {"logprobs_mode": "raw_logits"}}, "logprobs_mode"),
    ("/inference/v1/generate", {"token_ids": [10], "sampling_params": {"return_sampling_mask": "yes"}},
     "return_sampling_mask"),
    ("/inference/v1/generate", {"token_ids": [10], "sampling_params": {}, "return_token_ids": 1}, "return_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logprobs_mode": "processed"}, "logprobs_mode"),  # ours, not vLLM's name
    ("/generate", {"text": "hi", "return_sampling_mask": "true"}, "return_sampling_mask"),
    ("/generate", {"text": "hi", "sampling_params": {"logprobs_mode": "processed_logprobs"}}, "logprobs_mode"),
])
def test_bad_values_are_a_422_in_the_dialects_shape(client, model, path, body, field):
    if path == "/v1/completions":
        body = {**body, "model": model}
    reply = client.post(path, json=body, headers=auth())
    assert reply.status_code == 422, reply.get_json()
    assert field in str(reply.get_json()["error"]), reply.get_json()
    assert client.get("/v1/jobs", headers=auth()).get_json()["data"] == []


def _job(**choice) -> dict:
    return {"id": "job_1", "status": "succeeded", "created_at": 1.0, "completed_at": 2.0, "result": {
        "prompt_token_ids": [1, 3, 3, 3, 3, 2], "placeholder_ranges": IMAGE, "weight_version": "v0",
        "usage": {"prompt_tokens": 6, "completion_tokens": 2},
        "choices": [{"index": 0, "token_ids": [7, 7], "logprobs": [-0.5, 0.0], "finish_reason": "length",
                     "text": "xx", **choice}]}}


def _request(mask: bool) -> dict:
    return {"token_ids": [1, 3, 2], "sampling_params": {"n": 1, "logprobs": True, "sampling_mask": mask}}


def test_vllm_reply_has_the_csr_mask_and_the_prompts_placeholders(app):
    with app.test_request_context():
        reply = generate_reply({"sampling_params": {"logprobs": 0}}, _request(True), _job(sampling_mask=MASK))
    assert reply["choices"][0]["sampling_mask"] == MASK
    assert reply["prompt_token_ids"] == [1, 3, 3, 3, 3, 2]
    assert reply["mm_placeholders"] == {"image": [{"offset": 1, "length": 4}]}


def test_sglang_reply_has_a_list_of_ids_per_token(app):
    options = {"logprob_start_len": None, "top_logprobs_num": 0}
    with app.test_request_context():
        (asked,) = job_replies(_request(True), options, _job(sampling_mask=MASK), None)
        (plain,) = job_replies(_request(False), options, _job(), None)
    assert asked["meta_info"]["output_token_sampling_mask"] == [[5, 7, 9], [7]]
    assert "output_token_sampling_mask" not in plain["meta_info"]
    assert sampling_mask_rows(None) == [] and sampling_mask_rows({"token_ids": [], "offsets": [0]}) == []


def test_openai_replies_have_the_mask_only_when_asked(app):
    with app.test_request_context():
        completion = completion_reply({"prompt": [1, 3, 2]}, [_request(True)], [_job(sampling_mask=MASK)], 0)
        chat = chat_reply({}, _request(True), _job(sampling_mask=MASK), 0)
        plain = chat_reply({}, _request(False), _job(), 0)
    assert completion["choices"][0]["sampling_mask"] == MASK and chat["choices"][0]["sampling_mask"] == MASK
    assert "sampling_mask" not in plain["choices"][0]
