"""The OpenAI-compatible routes with the official ``openai`` client as the caller, over HTTP on
loopback, against the real workers: completions, chat with an image, logprobs, vLLM's extensions
(``return_token_ids``, ``return_tokens_as_token_ids``, top_k, ...) and OpenAI-shaped errors."""

from __future__ import annotations

import math

import openai
import pytest
import requests

from tests.e2e.conftest import API_KEY
from tests.e2e.dialect_server import serve
from tests.e2e.test_jobs_e2e import image_data_url


@pytest.fixture(scope="module")
def server(stack):
    with serve(stack) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    (served,) = client.models.list().data
    return served.id


def test_models_lists_the_served_model(client, stack):
    (served,) = client.models.list().data
    assert served.id == "demo-qwen2-vl" or served.id == stack.services.settings.model
    assert served.model_extra["max_model_len"] == stack.services.limits.context_tokens


def test_completions_with_logprobs_match_a_native_job(client, model, stack):
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0,
                                    logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    (choice,) = out.choices
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 5
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 5 and len(choice.logprobs.tokens) == 5
    # The sampled (greedy, so most likely) token and the runner-up; two tokens may share a spelling.
    assert all(1 <= len(step) <= 2 for step in choice.logprobs.top_logprobs)
    assert all(step[token] == lp for step, token, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.tokens,
                                                           choice.logprobs.token_logprobs, strict=True))
    native = stack.client.post("/v1/generate", json={"token_ids": choice.model_extra["prompt_token_ids"],
                                                     "sampling_params": {"max_tokens": 5, "temperature": 0,
                                                                         "ignore_eos": True}},
                               headers=stack.headers()).get_json()
    assert native["choices"][0]["token_ids"] == ids
    assert choice.logprobs.token_logprobs == pytest.approx(native["choices"][0]["logprobs"], abs=1e-6)
    assert choice.text == native["choices"][0]["text"]


def test_completions_batches_tokens_and_token_id_spelling(client, model):
    out = client.completions.create(model=model, prompt=[[101, 102, 103], [104, 105]], max_tokens=3, n=2,
                                    temperature=1.0, seed=3, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True, "top_k": 50, "min_p": 0.01,
                                                "min_tokens": 3, "repetition_penalty": 1.1, "ignore_eos": True,
                                                "skip_special_tokens": False, "return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        ids = choice.model_extra["token_ids"]
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
        # logprobs=0 still gives the sampled token's logprob
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert [list(step) for step in choice.logprobs.top_logprobs] == [[f"token_id:{t}"] for t in ids]
    assert out.usage.prompt_tokens == 5


def test_echo_returns_the_prompt_and_its_logprobs(client, model):
    out = client.completions.create(model=model, prompt="Hello there", max_tokens=2, temperature=0, echo=True,
                                    logprobs=1)
    (choice,) = out.choices
    assert choice.text.startswith("Hello there")
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == out.usage.total_tokens


def test_chat_with_an_image_logprobs_and_token_ids(client, model, stack):
    url = image_data_url(color=(250, 10, 10))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What colour is it?"}]}]
    out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    (choice,) = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    content = choice.logprobs.content
    assert len(content) == 4 and all(len(item.top_logprobs) == 3 for item in content)
    assert all(math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-6) for item in content)
    prompt_ids = out.model_extra["prompt_token_ids"]
    assert len(choice.model_extra["token_ids"]) == 4
    # The same conversation rendered by /v1/render: identical expanded prompt ids.
    rendered = stack.client.post("/v1/render", json={"messages": messages}, headers=stack.headers()).get_json()
    assert rendered["token_ids"] == prompt_ids
    raw = url.split(",", 1)[1]
    again = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": raw}},
                                               {"type": "text", "text": "What colour is it?"}]}])
    assert again.choices[0].model_extra["token_ids"] == choice.model_extra["token_ids"]


def test_plain_chat_and_stop_reasons(client, model):
    first = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    ids = first.choices[0].model_extra["token_ids"]
    stopped = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=6, temperature=0,
                                             extra_body={"stop_token_ids": [ids[1]], "return_token_ids": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == ids[1]
    assert stopped.choices[0].model_extra["token_ids"] == ids[:2]


def test_errors_are_in_openais_shape(client, server, model):
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    with pytest.raises(openai.UnprocessableEntityError) as knob:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       logit_bias={"5": 10})
    assert knob.value.body["param"] == "logit_bias"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    raw = requests.post(f"{server}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -3},
                        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert set(raw["error"]) == {"message", "type", "param", "code"} and raw["error"]["param"] == "max_tokens"


def test_past_the_sync_limit_is_a_504_in_openais_shape(stack, model):
    with serve(stack, sync_timeout_max=0.05) as (url, _):  # far below 3,000 decode steps
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.APIStatusError) as slow:
            client.completions.create(model=model, prompt=[101, 102], max_tokens=3000,
                                      extra_body={"ignore_eos": True})
    assert slow.value.status_code == 504 and slow.value.body["code"] == "sync_timeout"


def test_tokenize_and_detokenize(server, model):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = requests.post(f"{server}/tokenize", json={"model": model, "prompt": "Hello there"}, headers=headers,
                           timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = requests.post(f"{server}/detokenize", json={"model": model, "tokens": tokens["tokens"]}, headers=headers,
                         timeout=30).json()
    assert text["prompt"] == "Hello there"
    chat = requests.post(f"{server}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                         headers=headers, timeout=30).json()
    assert chat["count"] > tokens["count"] - 2


def test_areals_knobs_use_beam_search_false_and_a_top_k_past_the_vocabulary(client, model):
    """AReaL always sends ``use_beam_search: false`` and ``top_k: 100000000`` (no top-k, as in vLLM)."""
    plain = client.completions.create(model=model, prompt="The weather today", max_tokens=4, temperature=1.0,
                                      seed=5, extra_body={"ignore_eos": True, "return_token_ids": True})
    areal = client.completions.create(model=model, prompt="The weather today", max_tokens=4, temperature=1.0,
                                      seed=5, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                          "use_beam_search": False, "top_k": 100_000_000})
    assert areal.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    with pytest.raises(openai.UnprocessableEntityError) as beams:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"use_beam_search": True})
    assert beams.value.body["param"] == "use_beam_search"


def test_vllms_prompt_logprobs_extra_is_returned_not_dropped(server, model, stack):
    """vLLM's chat and completion replies carry ``prompt_logprobs`` when asked (it was computed, then
    dropped): the same numbers as the job's own (which the fidelity contract checks)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    completion = requests.post(f"{server}/v1/completions", headers=headers, timeout=60, json={
        "model": model, "prompt": [100, 140, 150], "max_tokens": 1, "prompt_logprobs": 1}).json()
    chat = requests.post(f"{server}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0,
        "return_token_ids": True}).json()
    native = stack.client.post("/v1/generate", headers=stack.headers(), json={
        "token_ids": [100, 140, 150], "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}}).get_json()
    got = completion["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == 3
    assert [step[str(t)]["logprob"] for step, t in zip(got[1:], [140, 150], strict=True)] == pytest.approx(
        native["prompt_logprobs"][1:], abs=1e-6)
    assert all(len(step) <= 2 for step in got[1:])  # the prompt token and the top 1
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None


def test_cached_prompt_tokens_parse_as_the_openai_client_reads_them(client, model):
    """``usage.prompt_tokens_details.cached_tokens``, read by the openai package's own models: a
    prompt sent again under the same ``cache_salt`` is found whole in the KV pool."""
    prompt = list(range(300, 340))
    salt = {"cache_salt": "openai-client-usage"}
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=salt)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=salt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt)
    assert again.choices[0].text == first.choices[0].text
