"""tool_choice required or named on OpenAI chat (#57 item 2) against the demo-qwen3 model, no
workers: the request's job carries a ``tool_calls`` constraint in the model's own call format
(Hermes' <tool_call> JSON: xgrammar's qwen_3 structural tag) with the body's tools, choice,
parallel_tool_calls and reasoning; a model whose parser no grammar writes is a 422. The engine's
side (what such a constraint samples) is tests/engine/test_forced_tool_calls.py."""

from __future__ import annotations

import pytest

from tests.web.conftest import auth
from tests.web.dialects.test_chat_tools_api import ASK, WEATHER, app  # noqa: F401 (a fixture)

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def _constraint(client) -> dict:
    (job,) = client.get("/v1/jobs", headers=auth()).get_json()["data"]
    return client.application.extensions["rollout"].jobs.get(job["id"])["request"]["sampling_params"][
        "structured_output"]


@pytest.mark.parametrize(("extra", "want"), [
    ({"tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False}},
     {"tool_choice": "required", "parallel_tool_calls": True, "reasoning": "disabled"}),
    ({"tool_choice": "required", "parallel_tool_calls": False},
     {"tool_choice": "required", "parallel_tool_calls": False, "reasoning": "enabled"}),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}, "chat_template_kwargs": {"enable_thinking": False}},
     {"tool_choice": {"type": "function", "function": {"name": "add"}}, "parallel_tool_calls": True,
      "reasoning": "disabled"}),
])
def test_a_forced_choice_makes_the_job_a_tool_calls_constraint(app, extra, want):  # noqa: F811
    client = app().test_client()
    body = {"messages": ASK, "tools": [WEATHER, ADD], "max_tokens": 2, "stream": True, **extra}
    assert client.post("/v1/chat/completions", json=body, headers=auth()).status_code == 200
    assert _constraint(client) == {"tool_calls": {"format": "qwen_3", "tools": [WEATHER, ADD], **want}}


def test_auto_and_none_constrain_nothing(app):  # noqa: F811
    client = app().test_client()
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 2, "stream": True}
    assert client.post("/v1/chat/completions", json=body, headers=auth()).status_code == 200
    assert _constraint(client) is None


def test_a_parser_no_grammar_writes_is_a_422(app):  # noqa: F811
    client = app(tool_call_parser="mistral").test_client()
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 2}
    reply = client.post("/v1/chat/completions", json=body, headers=auth())
    assert reply.status_code == 422 and reply.get_json()["error"]["code"] == "tool_choice_unsupported"
