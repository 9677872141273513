"""Bad input on the OpenAI routes is a clear 4xx in OpenAI's error shape, never a 5xx and never a
job (#57 item 6), on chat completions and the Responses API alike, against the demo-qwen3 model
with no workers: each body is sent with ``stream: true``, so one the API let through would answer
200 and leave a queued job. (A grammar that compiles too slowly is refused by the GPU worker's
compile bound: tests/engine/test_structured_output.py.)"""

from __future__ import annotations

import pytest
import redis

from domain.settings import Settings
from tests.web.conftest import KEY_A, auth
from web.app import create_app
from web.dialects.openai.responses import responses_field

ASK = [{"role": "user", "content": "Hi"}]
CHAT_TOOL = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
FLAT_TOOL = {"type": "function", "name": "w", "parameters": {"type": "object"}}
BAD_SCHEMA = {"type": "no-such-type"}
BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 50} for i in range(1500)}}
CALL = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}


def _chat_format(schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _text_format(schema):
    return {"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}


# case: (chat body, Responses body, the param the chat error names; the Responses error names it
# as its body does: input, text.format, tools[i].parameters, tool_choice.name)
CASES = {
    "named tool not in tools": (
        {"messages": ASK, "tools": [CHAT_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"input": "Hi", "tools": [FLAT_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice.function.name"),
    "invalid schema": ({"messages": ASK, **_chat_format(BAD_SCHEMA)}, {"input": "Hi", **_text_format(BAD_SCHEMA)},
                       "response_format"),
    "schema not an object": ({"messages": ASK, **_chat_format(5)}, {"input": "Hi", **_text_format(5)}, None),
    "oversized schema": ({"messages": ASK, **_chat_format(BIG_SCHEMA)}, {"input": "Hi", **_text_format(BIG_SCHEMA)},
                         None),
    "invalid tool schema, call forced": (
        {"messages": ASK, "tools": [{"type": "function", "function": {"name": "w", "parameters": BAD_SCHEMA}}],
         "tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False}},
        {"input": "Hi", "tools": [{**FLAT_TOOL, "parameters": BAD_SCHEMA}], "tool_choice": "required",
         "reasoning": {"effort": "none"}},
        "tools[0].function.parameters"),
    "tool message answering no call": (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "c1", "content": "x"}], "tools": [CHAT_TOOL]},
        {"input": [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "c1", "output": "x"}],
         "tools": [FLAT_TOOL]},
        "messages[1]"),
    "tool message answering another call": (
        {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "c2", "content": "x"}], "tools": [CHAT_TOOL]},
        {"input": [{"role": "user", "content": "Hi"},
                   {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c2", "output": "x"}], "tools": [FLAT_TOOL]},
        "messages[2].tool_call_id"),
}
TOKENS = {"token out of the vocabulary": [10**8], "tokens over the context": [1] * 5000}


@pytest.fixture
def client(web_redis_url, qwen3_dir, tmp_path):
    redis.Redis.from_url(web_redis_url).flushdb()
    app = create_app(Settings(state_dir=tmp_path, model=str(qwen3_dir), api_keys=(KEY_A,)), web_redis_url)
    app.config["TESTING"] = True
    return app.test_client()


def _refused(client, path: str, body: dict, param: str | None) -> None:
    reply = client.post(path, json={**body, "stream": True}, headers=auth())
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.get_data()[:300])
    error = reply.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and error["code"] and error["param"]
    if param is not None:
        assert error["param"] == param, error
    assert client.get("/v1/jobs", headers=auth()).get_json()["data"] == []  # nothing ran


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_bad_input_is_a_4xx_in_openais_shape(client, route, case):
    chat, responses, param = CASES[case]
    if route == "/v1/chat/completions":
        _refused(client, route, chat, param)
    else:
        _refused(client, route, responses, param and responses_field(param))


@pytest.mark.parametrize("case", TOKENS)
def test_bad_tokens_are_a_4xx_in_openais_shape(client, case):
    _refused(client, "/v1/chat/completions/tokens", {"messages": ASK, "tokens": TOKENS[case], "max_tokens": 2}, None)


def test_chat_fields_are_named_as_the_responses_body_names_them():
    assert [responses_field(name) for name in ("messages[2].tool_call_id", "response_format", "tools[0].function.parameters",
                                               "tool_choice.function.name", "max_tokens", "temperature")] == \
        ["input", "text.format", "tools[0].parameters", "tool_choice.name", "max_output_tokens", "temperature"]
