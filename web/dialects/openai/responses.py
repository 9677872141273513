"""OpenAI's Responses API, ``POST /v1/responses`` and ``GET /v1/responses/{id}``: the request made
a chat body (web/dialects/openai/responses_input.py) and run on the chat route's path (its
session turns, parsers and job), the chat reply made output items: ``reasoning`` (the reasoning
parser's), ``message`` (``output_text``) and ``function_call`` (``call_id``, ``name``,
``arguments``).

With ``store`` (OpenAI's default) the response is kept, owner-scoped, for ``ROLLOUT_RESULT_TTL``
(domain/sessions/response_store.py) with the session its turn was recorded in; a call naming it
as ``previous_response_id`` is that conversation, its assistant message as returned and the new
input, run in a copy of its session as that response left it (each response records in a session of
its own, so calls continuing one response branch apart): its prompt is the previous prompt and
sampled ids exactly, then the template's bridge (web/dialects/openai/session_turns.py;
``response.session`` says whether it continued and, if not, why, and names the session whose
trajectory is the whole chain).

Shapes matched (not copied) from the official ``openai`` client's types
(openai/types/responses/response.py, response_create_params.py)."""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

import flask
from marshmallow import ValidationError, fields, validate, validates_schema

from domain.infra.store_errors import STORE_FAILURES
from domain.jobs.results import JobResult
from domain.sessions.response_store import ResponseStore, StoredResponse
from domain.sessions.store import SessionStore
from engine.errors import InvalidRequestError, NotFoundError, RolloutError
from web.api.schemas import StrictBoolean
from web.api.session_header import session_id_of, validate_session_id
from web.auth import current_owner
from web.dialects.common import reply_model_name
from web.dialects.errors import flatten
from web.dialects.fields import NullMeansDefault, refuse_non_default
from web.dialects.openai import request as chat_schema
from web.dialects.openai.chat import chat_reply
from web.dialects.openai.responses_input import (
    chat_tool_choice,
    chat_tools,
    input_messages,
    response_format,
    thinking_kwargs,
)
from web.dialects.openai.session_turns import SessionTurn, chat_turn
from web.services import services

# Accepted only at these values: what this service cannot honour is never dropped silently.
_UNSUPPORTED = {"background": (False,), "truncation": ("disabled",), "include": (None, []),
                "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,), "top_logprobs": (None, 0)}


class ResponseNotFoundError(NotFoundError):
    code = "response_not_found"


class ResponsesRequestSchema(NullMeansDefault):
    model = fields.String()
    input = fields.Raw(required=True, metadata={"description": "A string, or input items (messages, function_call, "
                                                               "function_call_output, reasoning)"})
    instructions = fields.String(metadata={"description": "A system message before the input (not carried over)"})
    previous_response_id = fields.String(validate=validate.Length(1, 128))
    tools = fields.List(fields.Dict())
    tool_choice = fields.Raw()
    parallel_tool_calls = StrictBoolean()
    reasoning = fields.Dict(metadata={"description": "effort: none turns the template's enable_thinking off"})
    max_output_tokens = fields.Integer(strict=True, validate=validate.Range(min=1))
    temperature = fields.Float(validate=validate.Range(0, 2))
    top_p = fields.Float(validate=validate.Range(0, 1))
    text = fields.Dict(metadata={"description": "format: text, json_object or json_schema (structured outputs)"})
    store = StrictBoolean(metadata={"description": "Keep the response for previous_response_id (default true)"})
    stream = StrictBoolean()
    metadata = fields.Dict(keys=fields.String(), values=fields.String())
    user = fields.String()
    safety_identifier = fields.String()
    prompt_cache_key = fields.String()
    service_tier = fields.String()
    session_id = fields.String(validate=validate_session_id)
    background = fields.Raw()
    truncation = fields.Raw()
    include = fields.Raw()
    conversation = fields.Raw()
    prompt = fields.Raw()
    max_tool_calls = fields.Raw()
    top_logprobs = fields.Raw()

    @validates_schema
    def supported(self, data: dict, **_) -> None:
        refuse_non_default(data, _UNSUPPORTED)


def response_store() -> ResponseStore:
    svc = services()
    return ResponseStore(svc.redis, ttl=svc.settings.result_ttl)


def chat_body(body: dict[str, Any], previous: StoredResponse | None) -> dict[str, Any]:
    """The chat completions body of a Responses request (its conversation after ``previous``'s)."""
    history = [*previous.messages, previous.assistant] if previous is not None else []
    conversation = [*history, *input_messages(body["input"])]
    chat: dict[str, Any] = {"messages": ([{"role": "system", "content": body["instructions"]}]
                                         if body.get("instructions") else []) + conversation}
    for name, value in (("model", body.get("model")), ("tools", chat_tools(body.get("tools"))),
                        ("tool_choice", chat_tool_choice(body.get("tool_choice"))),
                        ("parallel_tool_calls", body.get("parallel_tool_calls")),
                        ("max_tokens", body.get("max_output_tokens")), ("temperature", body.get("temperature")),
                        ("top_p", body.get("top_p")), ("response_format", response_format(body.get("text")))):
        if value is not None:
            chat[name] = value
    if kwargs := thinking_kwargs(body.get("reasoning")):
        chat["chat_template_kwargs"] = kwargs
    try:  # chat's own schema: its bounds and refusals, named as chat names them
        return chat_schema.ChatCompletionRequestSchema().load(chat)
    except ValidationError as exc:
        errors = flatten(exc.messages)
        raise InvalidRequestError(f"invalid fields: {', '.join(errors)}", errors=errors) from None


def previous_of(body: dict[str, Any]) -> StoredResponse | None:
    name = body.get("previous_response_id")
    if name is None:
        return None
    stored = response_store().get(current_owner(), name)
    if stored is None:
        raise ResponseNotFoundError(f"Previous response with id '{name}' not found.",
                                    errors={"previous_response_id": ["no stored response of this key"]})
    return stored


def prepare(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], SessionTurn | None, StoredResponse | None]:
    """(chat body, job request, session turn, previous response) of a Responses request. A stored
    response's turn runs in a session: the previous response's, else the request's own
    (``session_id`` or X-Session-ID), else a new one."""
    previous = previous_of(body)
    chat = chat_body(body, previous)
    if body.get("store", True):
        chat["session_id"] = session_id_of(body, flask.request.headers) or "resp-" + secrets.token_hex(12)
        if previous is not None and previous.session_id:  # its session as it ended, this turn's own copy
            chat["session_id"] = "resp-" + secrets.token_hex(12)
            SessionStore(services().redis, ttl=services().settings.result_ttl).fork(
                current_owner(), previous.session_id, chat["session_id"])
    try:
        request, turn = chat_turn(chat)
    except RolloutError as error:  # chat's checks, their fields named as this body names them
        if isinstance(error.errors, dict):
            error.errors = {responses_field(name): value for name, value in error.errors.items()}
        raise
    return chat, request, turn, previous


# Chat's field names as the Responses body has them (the error's ``param``).
_FIELDS = ((re.compile(r"^messages\b.*"), "input"), (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
           (re.compile(r"^max_tokens"), "max_output_tokens"), (re.compile(r"^chat_template_kwargs"), "reasoning"),
           (re.compile(r"^(tools\[\d+\])\.function"), r"\1"), (re.compile(r"^tool_choice\.function"), "tool_choice"))


def responses_field(name: str) -> str:
    for pattern, replacement in _FIELDS:
        name = pattern.sub(replacement, name)
    return name


def output_items(message: dict[str, Any], call_ids: list[str] | None = None) -> list[dict[str, Any]]:
    """A chat reply's assistant message as output items: reasoning, then its text, then its calls."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item("rs_" + secrets.token_hex(12), message["reasoning_content"]))
    if message.get("content") or not (message.get("tool_calls") or items):
        items.append(message_item("msg_" + secrets.token_hex(12), message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        items.append(call_item("fc_" + secrets.token_hex(12), call["id"], call["function"]["name"],
                               call["function"]["arguments"]))
    return items


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_object(body: dict[str, Any], chat: dict[str, Any], response_id: str, created: int, *,
                    status: str = "in_progress", output: list | None = None, job: dict | None = None,
                    finish: str | None = None, turn: SessionTurn | None = None, model: str | None = None) -> dict[str, Any]:
    """The Response object: ``in_progress`` (no output yet), or its end from the job's result
    (``model``: the reply's model name, given where no request context is)."""
    out: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created, "model": model or reply_model_name(),
        "status": status, "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
        "output": output or [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning"),
        "store": body.get("store", True), "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled", "usage": None,
        "user": body.get("user")}
    if job is not None:
        result = JobResult.of(job, n=0)
        out["usage"] = {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
                        "total_tokens": result.prompt_tokens + result.completion_tokens,
                        "input_tokens_details": {"cached_tokens": result.cached_tokens},
                        "output_tokens_details": {"reasoning_tokens": 0}}
        if finish == "length":
            out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        elif finish in ("abort", "cancelled"):
            out["status"] = "cancelled"
        else:
            out["status"] = "completed"
    if turn is not None:
        out["session"] = turn.reply_field()
    return out


def ended(body: dict[str, Any], chat: dict[str, Any], request: dict[str, Any], turn: SessionTurn | None,
          job: dict[str, Any]) -> dict[str, Any]:
    """The response of an ended job (the chat reply's message as output items), its session turn
    recorded and, with ``store``, kept."""
    created = now()
    choice = chat_reply(chat, request, job, created)["choices"][0]
    reply = response_object(body, chat, "resp_" + job["id"].removeprefix("job_"), created,
                            output=output_items(choice["message"]), job=job, finish=choice["finish_reason"])
    if turn is not None:
        turn.record(job, request, choice["message"])
        reply["session"] = turn.reply_field()
    keep(body, chat, reply, choice["message"], turn, response_store(), current_owner(), services().redis_memory)
    return reply


def keep(body: dict[str, Any], chat: dict[str, Any], response: dict[str, Any], assistant: dict[str, Any],
         turn: SessionTurn | None, store: ResponseStore, owner: str, memory) -> None:
    """Store an ended response (``store``), below Redis' high-water mark as new work is."""
    if not body.get("store", True) or memory.read().above_high_water:
        return
    messages = chat["messages"][1:] if body.get("instructions") else chat["messages"]
    try:
        store.put(owner, StoredResponse(response, messages, assistant, turn.session_id if turn else None))
    except STORE_FAILURES:
        pass  # the response is still answered; a later previous_response_id naming it is a 404


def now() -> int:
    return int(time.time())
