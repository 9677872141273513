"""chat_template_kwargs reach the served chat template only as the variables it reads (#26): a
request's own template, apply_chat_template's own arguments and unknown names are a 422 naming
each, on /tokenize, /v1/chat/completions and vLLM's render route; the render refuses what it does
not honour."""

from __future__ import annotations

import pytest

from tests.web.conftest import auth

MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
                                         {"type": "text", "text": "Hi"}]}]
HOSTILE = {
    "chat_template": "PWNED{{ messages|length }}",
    "tokenize": True,
    "conversation": [],
    "add_generation_prompt": False,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "not_a_template_variable": 1,
}


@pytest.fixture
def model(client):
    return client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]


def _bodies(model, kwargs):
    return [("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": kwargs}),
            ("/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 1,
                                      "chat_template_kwargs": kwargs})]


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_kwarg_the_template_does_not_read_is_a_422_naming_it(client, model, name):
    for path, body in _bodies(model, {name: HOSTILE[name]}):
        reply = client.post(path, json=body, headers=auth())
        assert reply.status_code == 422, (path, reply.get_json())
        assert name in str(reply.get_json()), reply.get_json()
        assert "PWNED" not in reply.get_data(as_text=True)


def test_a_variable_the_served_template_reads_is_honoured(client):
    plain = client.post("/tokenize", json={"messages": MESSAGES}, headers=auth()).get_json()["tokens"]
    numbered = client.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"add_vision_id": True}},
                           headers=auth())
    assert numbered.status_code == 200 and numbered.get_json()["tokens"] != plain  # "Picture 1:" is written


def test_a_request_template_runs_only_when_the_operator_trusts_it(make_app):
    client = make_app(trust_request_chat_template=True).test_client()
    reply = client.post("/tokenize", json={"messages": MESSAGES, "add_special_tokens": False,
                                           "chat_template_kwargs": {"chat_template": "PWNED{{ messages|length }}"}},
                        headers=auth())
    assert reply.status_code == 200
    tokens = client.post("/detokenize", json={"tokens": reply.get_json()["tokens"]}, headers=auth()).get_json()
    assert tokens["prompt"] == "PWNED1"


@pytest.mark.parametrize("field", [{"chat_template_kwargs": {"add_vision_id": True}}, {"add_generation_prompt": False},
                                   {"stream": True}, {"tool_choice": "required"}])
def test_render_refuses_what_it_does_not_honour(client, model, field):
    reply = client.post("/v1/chat/completions/render", json={"model": model, "messages": MESSAGES, **field},
                        headers=auth())
    assert reply.status_code == 422 and next(iter(field)) in str(reply.get_json()), reply.get_json()


REFUSING = {"chat_template": "{{ raise_exception('roles must alternate user and assistant') }}"}
BROKEN = {"chat_template": "{% if messages %}unclosed"}


@pytest.mark.parametrize("kwargs", [REFUSING, BROKEN], ids=["raise_exception", "syntax_error"])
def test_a_template_that_refuses_the_conversation_is_a_422_with_its_reason(make_app, kwargs):
    client = make_app(trust_request_chat_template=True).test_client()
    model = client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]
    for path, body in _bodies(model, kwargs):
        reply = client.post(path, json=body, headers=auth())
        assert reply.status_code == 422, (path, reply.get_data(as_text=True)[:300])
        error = reply.get_json()
        error = error.get("error", error)
        assert error["code"] == "chat_template_refused", error
    assert "roles must alternate" in str(error) or kwargs is BROKEN


def test_a_batch_line_the_template_refuses_is_refused_alone(make_app):
    from tests.web.api.test_batches_api import jsonl
    from web.api.batch_upload import validate_lines
    from web.dialects.common import served_model_name
    from web.dialects.openai.batch_lines import CHAT_URL

    app = make_app(trust_request_chat_template=True)
    with app.test_request_context():
        def line(custom_id: str, **kwargs) -> dict:
            return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
                    "body": {"model": served_model_name(), "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2, **kwargs}}

        parsed = validate_lines(jsonl(line("ok"), line("refused", chat_template_kwargs=REFUSING), line("ok too")),
                                max_lines=10, endpoint=CHAT_URL)
    assert len(parsed.valid) == 2
    (refused,) = parsed.invalid
    assert refused["custom_id"] == "refused" and refused["status_code"] == 422
    assert refused["error"]["code"] == "chat_template_refused" and "roles must alternate" in refused["error"]["message"]
