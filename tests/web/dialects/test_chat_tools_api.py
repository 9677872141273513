"""Tools and reasoning on OpenAI chat against the demo-qwen3 model (#57 items 1 and 3), no workers:
tools reach the chat template (/tokenize and a chat job's prompt ids hold the rendered schema),
the history's calls and tool results are rendered, what is refused is a 422 naming it, and a
stored result whose tokens hold reasoning and a call becomes the reply's ``reasoning_content``,
``tool_calls`` and ``finish_reason: tool_calls``, plain and streamed (the stream assembled by the
official ``openai`` client's ``ChatCompletionStreamState`` to the same message)."""

from __future__ import annotations

import json

import pytest
import redis
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from domain.jobs.follow import ChoiceDelta, TokenLedger
from domain.settings import Settings
from engine.detokenize import decode_text
from tests.web.conftest import KEY_A, auth
from web.app import create_app
from web.dialects import openai as chat
from web.dialects.common import tokenizer
from web.dialects.openai.stream import ChatChunks

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
OUTPUT = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris"}}\n</tool_call>')


@pytest.fixture
def app(web_redis_url, qwen3_dir, tmp_path):
    def make(**overrides):
        redis.Redis.from_url(web_redis_url).flushdb()
        settings = Settings(state_dir=tmp_path, model=str(qwen3_dir), api_keys=(KEY_A,), **overrides)
        made = create_app(settings, web_redis_url)
        made.config["TESTING"] = True
        return made
    return make


@pytest.fixture
def client(app):
    return app().test_client()


def _tokens(client, body) -> list[int]:
    reply = client.post("/tokenize", json=body, headers=auth())
    assert reply.status_code == 200, reply.get_json()
    return reply.get_json()["tokens"]


def _rendered_tools(prompt: str) -> list[dict]:
    """The tools a Qwen3 prompt lists, one JSON object a line between <tools> and </tools>."""
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    return [json.loads(line) for line in listed.splitlines()]


def _text(client, ids) -> str:
    return client.post("/detokenize", json={"tokens": ids}, headers=auth()).get_json()["prompt"]


def test_tokenize_renders_the_tools_and_enable_thinking(client):
    plain = _text(client, _tokens(client, {"messages": ASK}))
    with_tools = _text(client, _tokens(client, {"messages": ASK, "tools": [WEATHER]}))
    assert "<tools>" not in plain and _rendered_tools(with_tools) == [WEATHER]
    off = _text(client, _tokens(client, {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not plain.endswith("</think>\n\n")


def test_a_chat_job_prompt_holds_the_tools_and_the_history_of_calls(client):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = client.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER], "tool_choice": "auto",
                                                      "parallel_tool_calls": True, "max_tokens": 2, "stream": True},
                        headers=auth())
    assert reply.status_code == 200
    [job] = client.get("/v1/jobs", headers=auth()).get_json()["data"]
    store = client.application.extensions["rollout"].jobs
    prompt = _text(client, store.get(job["id"])["request"]["token_ids"])
    assert _rendered_tools(prompt) == [WEATHER]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt


@pytest.mark.parametrize(("extra", "code"), [
    ({"tool_choice": {"type": "function", "function": {"name": "not_a_tool"}}}, "invalid_request"),
    ({"tool_choice": {"type": "function"}}, "invalid_request"),
    ({"tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False},
      "response_format": {"type": "json_object"}}, "invalid_grammar"),
    ({"tool_choice": "sometimes"}, "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "invalid_request"),
    ({"tools": [{"type": "retrieval"}]}, "invalid_request"),
    ({"parallel_tool_calls": "yes"}, "invalid_request"),
])
def test_what_is_not_served_is_a_422_naming_it(client, extra, code):
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 1, **extra}
    reply = client.post("/v1/chat/completions", json=body, headers=auth())
    assert reply.status_code == 422, reply.get_json()
    error = reply.get_json()["error"]
    assert error["code"] == code or (code == "invalid_request" and error["code"] in ("invalid_request", "validation_error")), error


def test_tools_on_a_model_whose_template_renders_none_are_a_422(web_redis_url, demo_model_dir, tmp_path):
    redis.Redis.from_url(web_redis_url).flushdb()
    other = create_app(Settings(state_dir=tmp_path, model=str(demo_model_dir), api_keys=(KEY_A,)), web_redis_url)
    for path in ("/v1/chat/completions", "/tokenize"):
        reply = other.test_client().post(path, json={"messages": ASK, "tools": [WEATHER]}, headers=auth())
        assert reply.status_code == 422 and reply.get_json()["error"]["code"] == "tools_unsupported"


def _stored_job(app, text: str, finish_reason: str = "stop") -> tuple[dict, list[int]]:
    """A finished job as a GPU worker stores it: the tokens of ``text`` and the text decoded from them."""
    tok = _tokenizer(app)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    choice = {"index": 0, "token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": finish_reason,
              "text": decode_text(tok, ids)}
    job = {"id": "job_x", "status": "succeeded", "created_at": 1.0, "completed_at": 2.0,
           "result": {"prompt_token_ids": [1, 2], "choices": [choice], "weight_version": "v1",
                      "usage": {"prompt_tokens": 2, "completion_tokens": len(ids)}}}
    return job, ids


@pytest.mark.parametrize("tools", [True, False])
def test_a_stored_result_with_reasoning_and_a_call_is_the_reply_plain_and_streamed(app, tools):
    made = app()
    job, ids = _stored_job(made, OUTPUT)
    tok_text = job["result"]["choices"][0]["text"]
    assert tok_text == OUTPUT  # <think> and <tool_call> survive decoding: added tokens, not special
    body = {"messages": ASK, **({"tools": [WEATHER]} if tools else {})}
    request = {"token_ids": [1, 2], "sampling_params": {"n": 1}}
    with made.test_request_context():
        reply = chat.chat_reply(body, request, job, 0)
        chunks = ChatChunks(body, [request])
    [choice] = reply["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == "\nThe user wants the weather.\n"
    if tools:
        assert choice["finish_reason"] == "tool_calls" and message["content"] is None
        [call] = message["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    else:  # no tools asked for: the markup is content, as the model wrote it
        assert choice["finish_reason"] == "stop" and message["tool_calls"] == []
        assert message["content"] == OUTPUT.split("</think>")[1]

    chunks.bind([job])
    ledger, sse = TokenLedger(), []
    tok_texts = [decode_text(_tokenizer(made), [t]) for t in ids]  # ASCII text: each token's own
    for token, piece in zip(ids[:-1], tok_texts[:-1], strict=True):
        sse += chunks.delta(job, ChoiceDelta("job_x", 0, [token], [-0.5], piece), ledger)
    sse += chunks.done(job, [ChoiceDelta("job_x", 0, [ids[-1]], [-0.5], tok_texts[-1], "stop")], ledger)
    state = ChatCompletionStreamState()
    raw_reasoning = ""
    for event in sse:
        data = event.decode().removeprefix("data: ").strip()
        parsed = json.loads(data)
        for entry in parsed["choices"]:
            raw_reasoning += entry["delta"].get("reasoning_content") or ""
        state.handle_chunk(ChatCompletionChunk.model_validate(parsed))
    final = state.get_final_completion().choices[0]
    assert raw_reasoning == message["reasoning_content"]
    assert final.finish_reason == choice["finish_reason"]
    assert (final.message.content or None) == message["content"]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def _tokenizer(app):
    with app.app_context():
        return tokenizer()


def test_enable_thinking_false_turns_the_qwen3_reasoning_parser_off(app):
    made = app()
    job, _ = _stored_job(made, "Just an answer.")
    request = {"token_ids": [1, 2], "sampling_params": {"n": 1}}
    with made.test_request_context():
        thinking = chat.chat_reply({"messages": ASK}, request, job, 0)["choices"][0]["message"]
        off = chat.chat_reply({"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}, request, job,
                              0)["choices"][0]["message"]
    # Thinking on and no </think>: cut off while thinking (vLLM's qwen3 reading); off: all content.
    assert thinking["reasoning_content"] == "Just an answer." and thinking["content"] is None
    assert off["reasoning_content"] is None and off["content"] == "Just an answer."


def test_the_parser_settings_override_the_template(app):
    made = app(reasoning_parser="none", tool_call_parser="none")
    job, _ = _stored_job(made, OUTPUT)
    request = {"token_ids": [1, 2], "sampling_params": {"n": 1}}
    with made.test_request_context():
        message = chat.chat_reply({"messages": ASK}, request, job, 0)["choices"][0]["message"]
    assert message["content"] == OUTPUT and message["reasoning_content"] is None
    reply = made.test_client().post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]}, headers=auth())
    assert reply.status_code == 422 and reply.get_json()["error"]["code"] == "tools_unsupported"
