"""The Responses API against the demo-qwen3 model, no workers (web/dialects/openai/responses*.py):
input items and flat tools make the prompt chat makes of the same conversation; a stored result
with reasoning and a call is reasoning and function_call items, plain and as events the official
client's ``ResponseStreamState`` assembles to the same items; a stored response's
``previous_response_id`` continues its session's ids; an unknown one is a 404."""

from __future__ import annotations

import pytest
import redis
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from domain.jobs.follow import ChoiceDelta, TokenLedger
from domain.settings import Settings
from engine.detokenize import decode_text
from tests.web.conftest import KEY_A, KEY_B, auth
from web.app import create_app
from web.dialects.common import tokenizer
from web.dialects.openai import responses as api
from web.dialects.openai.responses_stream import ResponseEvents

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
OUTPUT = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris"}}\n</tool_call>')


@pytest.fixture
def app(web_redis_url, qwen3_dir, tmp_path):
    redis.Redis.from_url(web_redis_url).flushdb()
    made = create_app(Settings(state_dir=tmp_path, model=str(qwen3_dir), api_keys=(KEY_A, KEY_B)), web_redis_url)
    made.config["TESTING"] = True
    made.json.sort_keys = False  # the tools reach the template in the order sent, as over HTTP
    return made


def _queued_prompt(client, path: str, body: dict) -> list[int]:
    """The prompt ids of the job a streamed request queued (no worker runs it)."""
    reply = client.post(path, json={**body, "stream": True}, headers=auth())
    assert reply.status_code == 200, reply.get_json()
    jobs = client.get("/v1/jobs", headers=auth()).get_json()["data"]
    store = client.application.extensions["rollout"].jobs
    return store.get(jobs[0]["id"])["request"]["token_ids"]


def test_input_items_and_flat_tools_are_the_prompt_chat_makes(app):
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "Look.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    responses = _queued_prompt(app.test_client(), "/v1/responses", {
        "input": items, "instructions": "Be brief.", "tools": [WEATHER], "reasoning": {"effort": "none"},
        "max_output_tokens": 4})
    chat = app.test_client().post("/tokenize", json={"messages": messages, "tools": [CHAT_WEATHER],
                                               "chat_template_kwargs": {"enable_thinking": False}},
                            headers=auth()).get_json()["tokens"]
    assert responses == chat


def _stored_job(app, text: str, prompt: list[int], finish_reason: str = "stop", job_id: str = "ab" * 8) -> dict:
    with app.app_context():
        tok = tokenizer()
        eot = tok.convert_tokens_to_ids("<|im_end|>")
        ids = tok(text, add_special_tokens=False)["input_ids"] + ([eot] if finish_reason == "stop" else [])
        text = decode_text(tok, ids)
    return {"id": "job_" + job_id, "status": "succeeded", "created_at": 1.0, "completed_at": 2.0, "result": {
        "prompt_token_ids": prompt, "weight_version": "v1", "usage": {"prompt_tokens": len(prompt),
                                                                      "completion_tokens": len(ids)},
        "choices": [{"index": 0, "token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": finish_reason,
                     "matched_stop": eot if finish_reason == "stop" else None, "text": text}]}}


def _run(app, body: dict, text: str, key=KEY_A, job_id: str = "ab" * 8) -> tuple[dict, dict]:
    """``body``'s job request and its response once the job ended with ``text`` (as a GPU worker stores it)."""
    with app.test_request_context(headers=auth(key)):
        app.preprocess_request()
        loaded = api.ResponsesRequestSchema().load(body)
        chat, request, turn, _ = api.prepare(loaded)
        return request, api.ended(loaded, chat, request, turn, _stored_job(app, text, request["token_ids"], job_id=job_id))


def test_a_reply_with_reasoning_and_a_call_is_its_items_plain_and_streamed(app):
    body = {"input": "Weather in Paris?", "tools": [WEATHER]}
    request, reply = _run(app, body, OUTPUT)
    assert reply["status"] == "completed" and reply["id"] == "resp_" + "ab" * 8
    reasoning, call = reply["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "\nThe user wants the weather.\n"
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "get_weather", '{"city": "Paris"}')
    assert call["call_id"].startswith("call_")
    with app.test_request_context(headers=auth()):
        app.preprocess_request()
        loaded = api.ResponsesRequestSchema().load(body)
        chat, request, turn, _ = api.prepare(loaded)
        events = ResponseEvents(loaded, chat, request, turn)
    job = _stored_job(app, OUTPUT, request["token_ids"])
    events.bind([job])
    text = job["result"]["choices"][0]["text"]
    raw = [*events.delta(job, ChoiceDelta(job["id"], 0, text=text[:30], token_ids=[1]), TokenLedger()),
           *events.delta(job, ChoiceDelta(job["id"], 0, text=text[30:70], token_ids=[1]), TokenLedger()),
           *events.done(job, [ChoiceDelta(job["id"], 0, text=text[70:], finish_reason="stop")], TokenLedger())]
    parsed = [__import__("json").loads(chunk.split(b"data: ", 1)[1]) for chunk in raw]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    assert parsed[0]["type"] == "response.created" and parsed[-1]["type"] == "response.completed"
    state = ResponseStreamState(input_tools=[], text_format=None)
    for event in parsed:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    final = parsed[-1]["response"]
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in final["output"]] == \
        [(i["type"], i.get("name"), i.get("arguments")) for i in reply["output"]]
    assert final["output"][0]["content"] == reply["output"][0]["content"]
    done = [p for p in parsed if p["type"] == "response.function_call_arguments.done"]
    assert [(d["name"], d["arguments"]) for d in done] == [("get_weather", '{"city": "Paris"}')]


def test_previous_response_id_continues_the_sampled_ids(app):
    off = {"reasoning": {"effort": "none"}}
    first, one = _run(app, {"input": "Hi there", **off}, "Hello! How can I help?")
    assert one["session"]["recorded"] and one["output"][0]["content"][0]["text"] == "Hello! How can I help?"
    second, two = _run(app, {"input": "And then?", "previous_response_id": one["id"], **off}, "Fine.",
                       job_id="cd" * 8)
    assert two["session"]["prompt"] == "continued" and two["session"]["id"] != one["session"]["id"]
    with app.app_context():
        sampled = tokenizer()("Hello! How can I help?<|im_end|>", add_special_tokens=False)["input_ids"]
    assert second["token_ids"][:len(first["token_ids"]) + len(sampled)] == first["token_ids"] + sampled
    # Another call continuing the first response branches apart: continued too, its own session.
    other, three = _run(app, {"input": "Or else?", "previous_response_id": one["id"], **off}, "No.", job_id="ef" * 8)
    assert three["session"]["prompt"] == "continued" and other["token_ids"][:len(first["token_ids"]) + len(sampled)] == first["token_ids"] + sampled
    for reply, request in ((two, second), (three, other)):
        trajectory = app.test_client().get(f"/v1/sessions/{reply['session']['id']}/trajectory", headers=auth()).get_json()
        [segment] = trajectory["segments"]  # one sequence: this branch's two turns
        assert trajectory["turns"] == 2 and segment["token_ids"][:len(request["token_ids"])] == request["token_ids"]
    client = app.test_client()
    assert client.get(f"/v1/responses/{one['id']}", headers=auth()).get_json() == one
    assert client.get(f"/v1/responses/{one['id']}", headers=auth(KEY_B)).status_code == 404  # owner-scoped
    missing = client.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"}, headers=auth())
    assert missing.status_code == 404 and missing.get_json()["error"]["param"] == "previous_response_id"

