"""vLLM's token-in-token-out routes over HTTP, called the way SkyRL and prime-rl call them: render
a conversation (``/v1/chat/completions/render``), pass ``token_ids`` and ``features`` through to
``/inference/v1/generate`` without looking inside, read ``choices[0].token_ids`` and
``choices[0].logprobs.content[].logprob``."""

from __future__ import annotations

import pytest
import requests

from tests.e2e.conftest import API_KEY
from tests.e2e.dialect_server import serve
from tests.e2e.test_jobs_e2e import image_data_url

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def base(stack):
    with serve(stack) as (url, _):
        yield url


@pytest.fixture(scope="module")
def model(base):
    return requests.get(f"{base}/v1/models", headers=HEADERS, timeout=30).json()["data"][0]["id"]


def post(base, path, body):
    return requests.post(f"{base}{path}", json=body, headers=HEADERS, timeout=120)


def test_render_then_generate_round_trips_an_image_conversation(base, model, stack):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url()}},
                                             {"type": "text", "text": "Describe."}]}]
    render = post(base, "/v1/chat/completions/render", {"model": model, "messages": messages}).json()
    assert render["features"]["mm_placeholders"]["image"][0]["length"] == 4
    body = {"model": model, "token_ids": render["token_ids"], "features": render["features"],
            "sampling_params": {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 1,
                                "skip_special_tokens": False, "logprobs": 0, "ignore_eos": True,
                                "prompt_logprobs": None, "min_p": None}, "stream": False}
    output = post(base, "/inference/v1/generate", body).json()
    choice = output["choices"][0]
    token_ids = choice["token_ids"]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(token_ids) == 4 == len(logprobs) and choice["finish_reason"] == "length"
    assert [entry["token"] for entry in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in token_ids]
    assert all(len(entry["top_logprobs"]) == 1 for entry in choice["logprobs"]["content"])
    # The same conversation through chat completions gives the same tokens.
    chat = post(base, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True,
                                                "return_token_ids": True}).json()
    assert chat["choices"][0]["token_ids"] == token_ids and chat["prompt_token_ids"] == render["token_ids"]
    job = stack.client.get(f"/v1/jobs/{output['job_id']}", headers=stack.headers()).get_json()
    assert job["result"]["prompt_token_ids"] == render["token_ids"]


def test_logprobs_k_prompt_logprobs_and_request_id(base):
    out = post(base, "/inference/v1/generate", {
        "request_id": "rl-7", "token_ids": [101, 102, 103],
        "sampling_params": {"max_tokens": 3, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1}}).json()
    assert out["request_id"] == "rl-7"
    content = out["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]
               for entry in content)
    prompt = out["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == 3 and "102" in prompt[1] and prompt[1]["102"]["logprob"] < 0
    no_logprobs = post(base, "/inference/v1/generate", {"token_ids": [101], "sampling_params": {"max_tokens": 2}})
    assert no_logprobs.json()["choices"][0]["logprobs"] is None and no_logprobs.json()["prompt_logprobs"] is None


def test_completion_render_and_content_parts(base, model):
    (rendered,) = post(base, "/v1/completions/render", {"model": model, "prompt": "Hello",
                                                         "max_tokens": 2, "temperature": 0}).json()
    assert rendered["sampling_params"] == {"max_tokens": 2, "temperature": 0}
    out = post(base, "/inference/v1/generate", {"token_ids": rendered["token_ids"], "features": rendered["features"],
                                                "sampling_params": rendered["sampling_params"]}).json()
    assert len(out["choices"][0]["token_ids"]) <= 2
    collapsed = post(base, "/tokenize", {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Hi",
                                         "add_special_tokens": False}).json()["tokens"]
    with_parts = post(base, "/inference/v1/generate", {
        "token_ids": collapsed,
        "content_parts": [{"type": "image_url", "url": image_data_url(), "uuid": "img-1"}],
        "sampling_params": {"max_tokens": 1}})
    assert with_parts.status_code == 200, with_parts.json()
    assert with_parts.json()["usage"]["prompt_tokens"] == len(collapsed) - 1 + 4  # one placeholder, 4 tokens


def test_errors_are_vllms(base, model):
    both = post(base, "/inference/v1/generate", {
        "token_ids": [1], "sampling_params": {}, "content_parts": [{"type": "image_url", "url": "https://x.test/a"}],
        "features": {"content_parts": []}})
    assert both.status_code == 422 and both.json()["error"]["param"] == "features"
    wrong = post(base, "/inference/v1/generate", {"token_ids": [1], "sampling_params": {}, "model": "other"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    knob = post(base, "/inference/v1/generate", {"token_ids": [1], "sampling_params": {"logit_bias": {"1": 2}}})
    assert knob.status_code == 422 and knob.json()["error"]["param"] == "sampling_params.logit_bias"


def test_generate_replies_carry_the_prompt_ids_the_model_consumed(base):
    """vLLM's newer token-in-token-out reply: ``prompt_token_ids`` with media pads expanded, so a
    trainer that sent one collapsed pad per image learns the real ids."""
    collapsed = post(base, "/tokenize", {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Hi",
                                         "add_special_tokens": False}).json()["tokens"]
    out = post(base, "/inference/v1/generate", {
        "token_ids": collapsed, "content_parts": [{"type": "image_url", "url": image_data_url()}],
        "sampling_params": {"max_tokens": 1, "top_k": 100_000_000}}).json()
    pad = collapsed[1]
    assert out["prompt_token_ids"] == collapsed[:1] + [pad] * 4 + collapsed[2:]
    assert out["usage"]["prompt_tokens"] == len(out["prompt_token_ids"])
