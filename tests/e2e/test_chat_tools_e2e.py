"""Tools and reasoning on OpenAI chat end to end (#57 items 1 and 3): the built-in demo-qwen3
model (ROLLOUT_DEMO_MODEL, built as ``rollout-queue up`` builds it), a real GPU worker, the API on
loopback and the official ``openai`` client. The random model never writes a call by itself, so
this checks what it can: the tools and the history reach the prompt (its ids, returned), the
reply and its stream have the parsed shape (reasoning while thinking, content with
``enable_thinking: false``) and agree. The parser-to-reply mapping of a real call is checked on a
stored result in tests/web/dialects/test_chat_tools_api.py."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.e2e.chat_demo import chat_demo_stack, openai_client
from tests.e2e.dialect_server import serve
from web.parsers.message import MessageParsers, parsed_message
from web.parsers.reasoning import REASONING_PARSERS
from web.parsers.tool import TOOL_PARSERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def stack(redis_url, loopback_host, tmp_path_factory):
    with chat_demo_stack(redis_url, loopback_host, tmp_path_factory, "tools-chat") as built:
        yield built


@pytest.fixture(scope="module")
def client(stack):
    with serve(stack) as (url, _):
        yield openai_client(url)


def test_tools_and_history_reach_the_prompt_and_the_reply_and_stream_agree(client, stack):
    model = client.models.list().data[0].id
    args = {"model": model, "messages": HISTORY, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 8,
            "temperature": 0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    reply = client.chat.completions.create(**args)
    prompt = stack.client.post("/detokenize", json={"tokens": reply.model_extra["prompt_token_ids"]},
                               headers=stack.headers()).get_json()["prompt"]
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listed.splitlines()] == [WEATHER]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    [choice] = reply.choices
    text = stack.client.post("/detokenize", json={"tokens": choice.model_extra["token_ids"]},
                             headers=stack.headers()).get_json()["prompt"]
    # Thinking on (Qwen3's default): the text up to a </think> is reasoning (all of it when none
    # was written), as vLLM's qwen3 parser reads it; then hermes calls.
    expected = parsed_message(text, MessageParsers(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"]()))
    assert choice.message.model_extra["reasoning_content"] == expected["reasoning_content"]
    assert choice.message.content == expected["content"]
    assert len(choice.message.tool_calls or []) == len(expected["tool_calls"])
    assert choice.finish_reason == "length"

    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**args, stream=True):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]  # the final-completion parse refuses "length"
    assert (streamed.message.content or None) == choice.message.content
    assert streamed.message.model_extra.get("reasoning_content") == choice.message.model_extra["reasoning_content"]
    assert streamed.finish_reason == "length"


def test_enable_thinking_false_closes_the_think_block_and_the_reply_is_content(client, stack):
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=HISTORY[:1], max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    prompt = stack.client.post("/detokenize", json={"tokens": reply.model_extra["prompt_token_ids"]},
                               headers=stack.headers()).get_json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    [choice] = reply.choices
    assert choice.message.model_extra["reasoning_content"] is None and choice.message.content


ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_tool_choice_calls_with_arguments_valid_against_the_schema(client, tool_choice):
    """#57 item 2: the call is constrained by a grammar, so even the random model calls, and its
    stream assembles to the same call."""
    model = client.models.list().data[0].id
    args = {"model": model, "messages": HISTORY[:1], "tools": [CITY, ADD], "tool_choice": tool_choice,
            "parallel_tool_calls": False, "max_tokens": 300, "seed": 4,
            "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    [choice] = client.chat.completions.create(**args).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    schema = {"add": ADD, "get_weather": CITY}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(tool_choice, dict):
        assert call.function.name == "add"
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**args, stream=True):
        state.handle_chunk(chunk)
    [streamed] = state.get_final_completion().choices
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)]


def test_a_named_tool_not_in_tools_is_an_openai_error(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model=model, messages=HISTORY[:1], tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "nope" in refused.value.message
