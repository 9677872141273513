"""Session turns on OpenAI chat against the demo-qwen3 model, no workers
(web/dialects/openai/session_turns.py): a turn's job stored as a GPU worker stores it, recorded as
the reply returned it; the next turn that extends it gets the last prompt and sampled ids plus the
bridge the template writes before the new messages (a reply that ended on ``<|im_end|>``:
``end_of_turn`` sampled); a turn with other
tools, media or messages that do not extend it is rendered and says why; ``n`` > 1 has no session."""

from __future__ import annotations

import pytest
import redis

from domain.settings import Settings
from tests.web.conftest import KEY_A, auth
from web.app import create_app
from web.dialects import openai as chat
from web.dialects.common import tokenizer
from web.dialects.openai.session_turns import chat_turn

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "Hi there"}]
PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
       "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==")


@pytest.fixture
def app(web_redis_url, qwen3_dir, tmp_path):
    redis.Redis.from_url(web_redis_url).flushdb()
    made = create_app(Settings(state_dir=tmp_path, model=str(qwen3_dir), api_keys=(KEY_A,)), web_redis_url)
    made.config["TESTING"] = True
    return made


def turn(app, body, reply_text=None, session="s1"):
    """``body``'s job request and session turn; with ``reply_text``, its job ended with the tokens
    of that text and ``<|im_end|>`` (as a GPU worker stores it) and recorded as the reply returns it."""
    with app.test_request_context(headers={**auth(), "X-Session-ID": session}):
        app.preprocess_request()  # the key's owner, as a request's hooks set it
        request, made = chat_turn(body)
        if reply_text is None or made is None:
            return request, made, None
        tok = tokenizer()
        eot = tok.convert_tokens_to_ids("<|im_end|>")
        ids = tok(reply_text, add_special_tokens=False)["input_ids"] + [eot]
        job = {"id": "job_x", "status": "succeeded", "created_at": 1.0, "completed_at": 2.0, "result": {
            "prompt_token_ids": request["token_ids"], "weight_version": "v1",
            "usage": {"prompt_tokens": len(request["token_ids"]), "completion_tokens": len(ids)},
            "choices": [{"index": 0, "token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop",
                         "matched_stop": eot, "text": reply_text}]}}
        reply = chat.chat_reply(body, request, job, 0)
        made.record(job, request, reply["choices"][0]["message"])
        return request, made, reply["choices"][0]["message"]


def test_an_extending_turn_continues_the_sampled_ids_and_equals_the_templates_prompt(app):
    first, one, message = turn(app, {"messages": ASK, **OFF}, "Hello! How can I help?")
    assert (one.prompt, one.reason, one.recorded) == ("rendered", "first_turn", True)
    assert first["sampling_params"]["logprobs"] is True  # the trajectory's, asked or not
    messages = [*ASK, message, {"role": "user", "content": "And then?"}]
    second, two, _ = turn(app, {"messages": messages, **OFF})
    assert (two.prompt, two.reason, two.end_of_turn) == ("continued", None, "sampled")
    with app.app_context():
        tok = tokenizer()
        sampled = tok("Hello! How can I help?<|im_end|>", add_special_tokens=False)["input_ids"]
        assert second["token_ids"][:len(first["token_ids"]) + len(sampled)] == first["token_ids"] + sampled
        # What follows is the template's own, and what the model saw stays (its empty think block,
        # which rendering the conversation again would drop).
        assert tok.decode(second["token_ids"]) == tok.decode(first["token_ids"]) + (
            "Hello! How can I help?<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize(("change", "reason"), [
    ({"tools": [WEATHER]}, "context_changed"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "context_changed"),
    ({"messages": [{"role": "user", "content": "Other start"}, {"role": "user", "content": "x"}]},
     "messages_do_not_extend"),
    ({"media": True}, "media"),
])
def test_a_turn_that_cannot_continue_is_rendered_and_says_why(app, change, reason):
    _, _, message = turn(app, {"messages": ASK, **OFF}, "Hello!")
    new = {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image_url", "image_url": {"url": PNG}}]} \
        if change.pop("media", False) else {"role": "user", "content": "And then?"}
    body = {"messages": [*ASK, message, new], **OFF, **change}
    request, made, _ = turn(app, body)
    assert (made.prompt, made.reason) == ("rendered", reason)
    with app.test_request_context(headers=auth()):
        assert request["token_ids"] == chat.chat_request(body)["token_ids"]


def test_a_sampled_media_placeholder_is_rendered_not_continued(app):
    _, _, message = turn(app, {"messages": ASK, **OFF}, "Look <|image_pad|> here")
    body = {"messages": [*ASK, message, {"role": "user", "content": "Next"}], **OFF}
    request, made, _ = turn(app, body)
    assert (made.prompt, made.reason) == ("rendered", "placeholder_sampled")
    with app.test_request_context(headers=auth()):
        assert request["token_ids"] == chat.chat_request(body)["token_ids"]


def test_no_turn_is_recorded_past_redis_high_water_mark(app, web_redis_url):
    client = redis.Redis.from_url(web_redis_url)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(int(used / 0.95)))  # below the bound, above its 0.9 mark
    try:
        _, made, _ = turn(app, {"messages": ASK, **OFF}, "Hello!")
    finally:
        client.config_set("maxmemory", "0")
        client.close()
    assert (made.recorded, made.not_recorded) == (False, "redis_memory_full")
    assert made.reply_field()["recorded"] is False
    assert turn(app, {"messages": ASK, **OFF})[1].reason == "first_turn"  # nothing was written


def test_another_session_or_several_choices_start_apart(app):
    _, _, message = turn(app, {"messages": ASK, **OFF}, "Hello!")
    body = {"messages": [*ASK, message, {"role": "user", "content": "Next"}], **OFF}
    assert turn(app, body, session="s2")[1].reason == "first_turn"
    assert turn(app, {**body, "n": 2})[1] is None
    assert turn(app, body)[1].prompt == "continued"


def test_the_tokens_route_refuses_media_and_bad_session_ids(app):
    client = app.test_client()
    media = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}]
    reply = client.post("/v1/chat/completions/tokens", json={"messages": media, "tokens": [1, 2]}, headers=auth())
    assert reply.status_code == 422 and reply.get_json()["error"]["param"] == "messages"
    bad = client.post("/v1/chat/completions", json={"messages": ASK, "session_id": " padded"}, headers=auth())
    assert bad.status_code == 422, bad.get_json()
    missing = client.get("/v1/sessions/nobody/trajectory", headers=auth())
    assert missing.status_code == 404 and missing.get_json()["code"] == "session_not_found"
