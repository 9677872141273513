"""The Responses API end to end (#57 item 5): the demo-qwen3 model, a real GPU worker, the API on
loopback and the official ``openai`` client's ``responses.create`` (plain and ``stream=True``) and
``responses.stream``.

- a text turn, then one chained by ``previous_response_id``: its session's trajectory is one
  sequence (the second prompt starts with the first prompt and sampled ids exactly), and the
  stored response reads back by ``GET /v1/responses/{id}``;
- a forced call (``tool_choice`` named, flat function tool) streamed: a function_call item whose
  arguments are valid against the tool's schema, the argument deltas adding up to ``.done``'s,
  then its ``function_call_output`` answering it in the next turn;
- ``text.format`` json_schema through ``responses.stream``: the final response's text valid JSON;
- a named tool not in ``tools`` is a 422 in OpenAI's shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.chat_demo import chat_demo_stack, openai_client
from tests.e2e.dialect_server import serve

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
OFF = {"reasoning": {"effort": "none"}}


@pytest.fixture(scope="module")
def stack(redis_url, loopback_host, tmp_path_factory):
    with chat_demo_stack(redis_url, loopback_host, tmp_path_factory, "responses") as built:
        yield built


@pytest.fixture(scope="module")
def served(stack):
    with serve(stack) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served)


def test_a_chained_turn_continues_the_first_turns_ids(client, served, stack):
    one = client.responses.create(input="Hi there", instructions="Be brief.", max_output_tokens=6, temperature=0)
    assert one.status == "incomplete" and one.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in one.output] == ["reasoning"]  # thinking on: all of it reasoning so far
    assert one.usage.output_tokens == 6
    two = client.responses.create(input="And then?", instructions="Be brief.", previous_response_id=one.id,
                                  max_output_tokens=6, temperature=0)
    session = two.model_extra["session"]
    assert session["prompt"] == "continued"  # in its own copy of the first turn's session
    trajectory = httpx.get(f"{served}/v1/sessions/{session['id']}/trajectory", headers=stack.headers(),
                           timeout=30).json()
    [segment] = trajectory["segments"]  # one sequence: turn two's prompt extends turn one's ids
    assert trajectory["turns"] == 2 and sum(segment["loss_mask"]) == 12
    assert client.responses.retrieve(two.id).model_dump() == two.model_dump()


def test_a_forced_call_streams_its_arguments_and_its_output_answers_it(client):
    args = {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 200, **OFF}
    events = list(client.responses.create(**args, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    [call] = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.name, done.arguments) == ("get_weather", call.arguments)
    answer = client.responses.create(previous_response_id=final.id, max_output_tokens=4, tools=[WEATHER], **OFF,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answer.model_extra["session"]["prompt"] == "continued"


def test_text_format_json_schema_through_the_stream_helper(client):
    model = client.models.list().data[0].id  # the stream helper asks for one
    with client.responses.stream(model=model, input="Is it fine?", max_output_tokens=200, **OFF,
                                 text={"format": {"type": "json_schema", "name": "ok", "schema": SCHEMA,
                                                  "strict": True}}) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


def test_a_named_tool_not_in_tools_is_a_422(client):
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.responses.create(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"})
    assert raised.value.body["param"] == "tool_choice.name"
