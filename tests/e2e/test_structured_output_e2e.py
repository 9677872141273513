"""Structured outputs through a real stack (#57 item 2): the official ``openai`` client's
``response_format`` (json_schema, strict) on chat, vLLM's ``structured_outputs`` choice on
completions and SGLang's ``regex``: the constraint travels with the job to the GPU worker, which
compiles it against the model's tokenizer; every reply obeys it. A schema xgrammar cannot compile
is found on the worker and still answers a 422 ``invalid_grammar``."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.e2e.conftest import API_KEY
from tests.e2e.dialect_server import serve

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "sunny": {"type": "boolean"},
                                           "degrees": {"type": "integer", "minimum": -30, "maximum": 50}},
          "required": ["city", "sunny", "degrees"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(stack):
    with serve(stack) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_chat_response_format_json_schema_gives_valid_json_for_every_choice(client):
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], n=4, seed=3, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}})
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_streamed_constrained_reply_is_the_plain_one(client):
    model = client.models.list().data[0].id
    args = {"model": model, "messages": [{"role": "user", "content": "Weather?"}], "seed": 8, "max_tokens": 200,
            "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}}
    plain = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        **args, stream=True) if chunk.choices)
    assert streamed == plain
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_completions_structured_outputs_choice(client):
    model = client.models.list().data[0].id
    options = ["red", "green", "blue"]
    reply = client.completions.create(model=model, prompt="Colour:", max_tokens=20, n=6, seed=1,
                                      extra_body={"structured_outputs": {"choice": options}})
    assert all(choice.text in options and choice.finish_reason == "stop" for choice in reply.choices)


def test_sglang_regex(stack):
    body = {"text": "Code:", "sampling_params": {"max_new_tokens": 30, "regex": "[A-Z]{3}-[0-9]{2}", "sampling_seed": 2}}
    reply = stack.client.post("/generate", json=body, headers=stack.headers())
    assert reply.status_code == 200, reply.get_json()
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", reply.get_json()["text"])


def test_a_schema_the_worker_cannot_compile_is_a_422(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert raised.value.code == "invalid_grammar"
    assert "no-such-type" in raised.value.message
