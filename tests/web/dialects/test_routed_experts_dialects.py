"""Routed experts in each dialect (#59 item 2): SGLang's ``return_routed_experts`` (top level, one
or per prompt), vLLM's and the OpenAI routes' ``return_routed_experts``, the native
``sampling_params.routed_experts`` map onto the native knob; a model without MoE layers refuses it
with a 422 naming the dialect's field; each reply carries the ids as its dialect encodes them
(SGLang: base64 of int32; vLLM: nested lists; native: packed uint8 with its shape). No workers
here; tests/e2e/test_routed_experts_e2e.py runs the engine."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from engine.routing.encoding import pack
from tests.web.conftest import auth
from web.dialects.openai.chat import chat_reply
from web.dialects.openai.completions import completion_reply
from web.dialects.sglang.request import job_replies
from web.dialects.vllm.request import generate_reply

IDS = np.arange(24, dtype=np.uint8).reshape(6, 2, 2) % 8  # 6 positions, 2 layers, top 2
PACKED = pack(IDS)


@pytest.fixture
def dense(make_app):
    return make_app(sync_timeout_max=0.2).test_client()


@pytest.fixture
def moe(web_redis_url, tmp_path):
    import redis

    from domain.settings import Settings
    from engine.demo_model import build_demo_model
    from tests.web.conftest import KEY_A
    from web.app import create_app

    redis.Redis.from_url(web_redis_url).flushdb()
    model = build_demo_model(tmp_path / "qwen3_moe", arch="qwen3_moe")
    app = create_app(Settings(state_dir=tmp_path, model=str(model), api_keys=(KEY_A,), sync_timeout_max=0.2),
                     web_redis_url)
    app.config["TESTING"] = True
    return app.test_client()


def _stored(client) -> dict:
    (job,) = client.get("/v1/jobs", headers=auth()).get_json()["data"]
    return client.application.extensions["rollout"].jobs.get(job["id"])["request"]["sampling_params"]


def _model(client) -> str:
    return client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]


def _bodies(model: str) -> list[tuple[str, dict, str]]:
    return [
        ("/generate", {"input_ids": [10, 11], "return_routed_experts": True,  # slime's, verl's SGLang payload
                       "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}, "return_routed_experts"),
        ("/inference/v1/generate", {"token_ids": [10, 11], "sampling_params": {"max_tokens": 2,
                                                                               "return_routed_experts": True}},
         "return_routed_experts"),
        ("/v1/completions", {"model": model, "prompt": [10, 11], "max_tokens": 2, "return_routed_experts": True},
         "return_routed_experts"),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "return_routed_experts": True}, "return_routed_experts"),
        ("/v1/generate", {"token_ids": [10, 11], "sampling_params": {"max_tokens": 2, "routed_experts": True}},
         "routed_experts"),
    ]


@pytest.mark.parametrize("index", range(5))
def test_each_dialects_flag_maps_onto_the_native_knob(moe, index):
    path, body, _ = _bodies(_model(moe))[index]
    assert moe.post(path, json=body, headers=auth()).status_code in (202, 504)  # no workers: queued
    assert _stored(moe)["routed_experts"] is True


@pytest.mark.parametrize("index", range(5))
def test_a_dense_model_refuses_it_naming_the_dialects_field(dense, index):
    path, body, field = _bodies(_model(dense))[index]
    reply = dense.post(path, json=body, headers=auth())
    assert reply.status_code == 422, reply.get_json()
    assert field in str(reply.get_json()) and "MoE" in str(reply.get_json())
    assert dense.get("/v1/jobs", headers=auth()).get_json()["data"] == []


def _job(**choice) -> dict:
    return {"id": "job_1", "status": "succeeded", "created_at": 1.0, "completed_at": 2.0, "result": {
        "prompt_token_ids": [1, 2, 3, 4, 5], "placeholder_ranges": [], "weight_version": "v0",
        "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        "choices": [{"index": 0, "token_ids": [7, 7], "logprobs": [-0.5, 0.0], "finish_reason": "length",
                     "text": "xx", **choice}]}}


def _request(asked: bool) -> dict:
    return {"token_ids": [1, 2, 3, 4, 5], "sampling_params": {"n": 1, "logprobs": True, "routed_experts": asked}}


def test_sglang_reply_is_base64_of_int32_as_slime_decodes_it(dense):
    options = {"logprob_start_len": None, "top_logprobs_num": 0}
    with dense.application.test_request_context():
        (asked,) = job_replies(_request(True), options, _job(routed_experts=PACKED), None)
        (plain,) = job_replies(_request(False), options, _job(), None)
    tokens = [1, 2, 3, 4, 5, 7, 7]  # slime: sample.tokens, prompt + output
    ids = np.frombuffer(base64.b64decode(asked["meta_info"]["routed_experts"].encode("ascii")), dtype=np.int32)
    np.testing.assert_array_equal(ids.reshape(len(tokens) - 1, 2, 2), IDS)
    assert "routed_experts" not in plain["meta_info"]


def test_vllm_and_openai_replies_are_nested_lists_only_when_asked(dense):
    with dense.application.test_request_context():
        generated = generate_reply({"sampling_params": {}}, _request(True), _job(routed_experts=PACKED))
        completion = completion_reply({"prompt": [1, 2, 3, 4, 5]}, [_request(True)], [_job(routed_experts=PACKED)], 0)
        chat = chat_reply({}, _request(True), _job(routed_experts=PACKED), 0)
        plain = chat_reply({}, _request(False), _job(), 0)
    for reply in (generated, completion, chat):
        assert reply["choices"][0]["routed_experts"] == IDS.tolist()
    assert "routed_experts" not in plain["choices"][0]


def test_the_native_reply_keeps_the_packed_ids(dense):
    from domain.jobs.results import JobResult

    [choice] = JobResult.of(_job(routed_experts=PACKED)).choices
    assert choice.routed_experts == {"dtype": "uint8", "shape": [6, 2, 2], "data": PACKED["data"]}


def test_the_server_flag_returns_them_on_vllms_routes_unless_a_request_says_no(web_redis_url, tmp_path):
    """ROLLOUT_RETURN_ROUTED_EXPERTS is vLLM's --enable-return-routed-experts: its clients (SkyRL's generator)
    send no per-request flag and read routed_experts on each choice."""
    import redis

    from domain.settings import Settings
    from engine.demo_model import build_demo_model
    from tests.web.conftest import KEY_A
    from web.app import create_app

    redis.Redis.from_url(web_redis_url).flushdb()
    model = build_demo_model(tmp_path / "qwen3_moe", arch="qwen3_moe")
    client = create_app(Settings(state_dir=tmp_path, model=str(model), api_keys=(KEY_A,), sync_timeout_max=0.2,
                                 return_routed_experts=True), web_redis_url).test_client()
    name = _model(client)
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    client.post("/v1/chat/completions", json=body, headers=auth())
    assert _stored(client)["routed_experts"] is True
    redis.Redis.from_url(web_redis_url).flushdb()
    client.post("/inference/v1/generate", json={"token_ids": [10], "sampling_params": {
        "max_tokens": 2, "return_routed_experts": False}}, headers=auth())
    assert _stored(client)["routed_experts"] is False


def test_sglang_routed_experts_start_len_sends_the_positions_from_there(dense):
    """SGLang's routed_experts_start_len (a next turn asks only for its new part)."""
    options = {"logprob_start_len": None, "top_logprobs_num": 0, "routed_experts_start_len": 4}
    with dense.application.test_request_context():
        (reply,) = job_replies(_request(True), options, _job(routed_experts=PACKED), None)
    ids = np.frombuffer(base64.b64decode(reply["meta_info"]["routed_experts"]), dtype=np.int32)
    np.testing.assert_array_equal(ids.reshape(-1, 2, 2), IDS[4:])
