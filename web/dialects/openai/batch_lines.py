"""Batch lines in the OpenAI Batch format: read them into job requests, write results back.

An input line is ``{"custom_id", "method": "POST", "url", "body"}`` (OpenAI's batch input, also
what vLLM's ``run_batch`` reads: ``BatchRequestInput`` in ``vllm/entrypoints/openai/run_batch.py``).
``url`` is one of:

- ``/v1/chat/completions``, ``/v1/completions``: the body is mapped by the OpenAI dialect
  (``web.dialects.openai``), the same schemas and functions as the synchronous routes, so a batch
  line and a call take the same knobs and give the same reply;
- ``/v1/jobs``: the body is our own job request (``kind: generate | score``), e.g. a score line
  with ``completion_token_ids``, whose result (prompt logprobs) is the response body as is.

Mapping needs the tokenizer and the chat template, which the API process holds: lines are mapped
here when the file is checked, and results are rendered here when they are downloaded. Workers
store each line's result as they do for native lines, plus the few reply options (``reply``) the
renderer needs, so the mapping functions stay in ``web/`` and nothing of them moves to workers.

An output or error line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`` (OpenAI's ``BatchRequestOutput``; vLLM writes the same keys). As OpenAI documents it,
``error`` is for a request that failed without an HTTP answer: here a line that never ran (not
JSON, wrong ``url`` or ``method``, duplicate ``custom_id``, cancelled, expired), as
``{"code", "message"}`` with ``response: null``. A request that was refused or failed carries the
status and the OpenAI-shaped error body our route would have answered, with ``error: null``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from marshmallow import ValidationError, fields, validate

from domain.infra import finite_json
from engine.errors import InvalidRequestError
from web.api.adapters import named_adapter
from web.api.schemas import JobRequestSchema
from web.dialects import openai
from web.dialects.common import served_model_name
from web.dialects.errors import openai_shape
from web.schema_base import Schema

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
JOBS_URL = "/v1/jobs"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, JOBS_URL)
# The request options the reply renderers read (web.dialects.openai.chat_reply / completion_reply).
_REPLY_OPTIONS = ("logprobs", "top_logprobs", "echo", "return_token_ids", "return_tokens_as_token_ids",
                  "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")


class LineShapeError(InvalidRequestError):
    """The line is not a request at all (no status: it is written as ``error``, never run)."""

    code = "invalid_line"


class EndpointMismatchError(LineShapeError):
    code = "endpoint_mismatch"


class UnsupportedUrlError(LineShapeError):
    code = "unsupported_url"


class OpenAILineSchema(Schema):
    custom_id = fields.String(required=True, validate=validate.Length(min=1, max=256))
    method = fields.String(required=True, validate=validate.OneOf(["POST"]))
    url = fields.String(required=True)
    body = fields.Dict(required=True)


# Built once: a marshmallow schema costs more to build than to load one line.
_LINE, _JOB = OpenAILineSchema(), JobRequestSchema()
_BODIES = {CHAT_URL: openai.ChatCompletionRequestSchema(), COMPLETIONS_URL: openai.CompletionRequestSchema()}


def is_openai_line(obj: Any) -> bool:
    return isinstance(obj, dict) and "url" in obj


def check_endpoint(url: str, endpoint: str | None) -> None:
    """A line's url must be its batch's endpoint (any supported url for a batch without one)."""
    if endpoint is not None and url != endpoint:
        raise EndpointMismatchError(f"the line's url {url!r} is not the batch's endpoint {endpoint!r}",
                                    errors={"url": [f"must be {endpoint!r}"]})


@dataclass
class PendingLine:
    """A line read up to its token ids: a chat line has its template rendered (``prompt``) and
    ``finish_line`` makes its job request; any other line has its ``request`` already."""

    custom_id: str
    url: str
    loaded: dict[str, Any]
    request: dict[str, Any] | None = None
    prompt: openai.ChatPrompt | None = None


def chat_token_ids(pendings: list[PendingLine], tok) -> list[list[int] | None]:
    """The token ids of each chat line among ``pendings`` (None for the others), from one call of
    ``tok`` (the API's tokenizer; this runs in any thread) for them all: what ``finish_line`` takes."""
    chats = [i for i, pending in enumerate(pendings) if pending.prompt is not None]
    token_ids: list[list[int] | None] = [None] * len(pendings)
    for i, ids in zip(chats, openai.chat_prompts_token_ids([pendings[i].prompt for i in chats], tok), strict=True):
        token_ids[i] = ids
    return token_ids


def begin_line(obj: dict, endpoint: str | None) -> PendingLine:
    """An OpenAI-format line read up to the token ids of a chat line (``finish_line`` completes it).
    Raises ``LineShapeError`` for a line that is no request, marshmallow's ``ValidationError`` or
    a ``RolloutError`` for a body its route would refuse."""
    try:
        line = _LINE.load(obj)
    except ValidationError as exc:
        raise LineShapeError("the line must be {custom_id, method: POST, url, body}", errors=exc.messages) from None
    url, body = line["url"], line["body"]
    if url not in ENDPOINTS:
        raise UnsupportedUrlError(f"url {url!r} is not served in batches; use one of {', '.join(ENDPOINTS)}",
                                  errors={"url": ["unsupported"]})
    check_endpoint(url, endpoint)
    with _body_errors():
        if url == JOBS_URL:
            request = _JOB.load(body)
            return PendingLine(line["custom_id"], url, body, request=named_adapter(request, request.get("adapter")))
        loaded = _BODIES[url].load(body)
        if url == CHAT_URL:
            return PendingLine(line["custom_id"], url, loaded, prompt=openai.chat_prompt(loaded))
        prompts, _ = openai.prompts_of(loaded["prompt"])
        if len(prompts) != 1:
            # One line, one job, one result: a list of prompts is one line per prompt.
            raise InvalidRequestError("a batch line takes one prompt; write one line per prompt",
                                      errors={"prompt": ["one prompt per line"]})
        (request,) = openai.completion_requests(loaded)
        return PendingLine(line["custom_id"], url, loaded, request=named_adapter(request, _adapter_of(loaded)))


def finish_line(pending: PendingLine, token_ids: list[int] | None) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """(custom_id, the native job request, how to render its reply or None) of a line
    ``begin_line`` read (a chat line with its ``token_ids``); raises as ``begin_line`` does."""
    if pending.url == JOBS_URL:
        return pending.custom_id, pending.request, None
    request = pending.request
    if pending.prompt is not None:
        with _body_errors():
            request = named_adapter(openai.chat_job_request(pending.prompt, token_ids), _adapter_of(pending.loaded))
    loaded, url = pending.loaded, pending.url
    reply = {"url": url, "n": request["sampling_params"]["n"],
             "body": {name: loaded[name] for name in _REPLY_OPTIONS if name in loaded}}
    if url == COMPLETIONS_URL and loaded.get("echo"):
        reply["body"]["prompt"] = loaded["prompt"]  # echo writes it back; kept only then
    return pending.custom_id, request, reply


def _adapter_of(loaded: dict) -> str | None:
    """The LoRA adapter a line's ``model`` names (its route's ``check_model`` let only the served
    model or one of the caller's adapters through), resolved now: the line runs later."""
    model = loaded.get("model")
    return model if model and model != served_model_name() else None


@contextmanager
def _body_errors() -> Iterator[None]:
    """A body's field errors named under ``body``, as the line's own."""
    try:
        yield
    except ValidationError as exc:
        raise ValidationError({"body": exc.messages}) from None


# --- Results --------------------------------------------------------------------------------------

def output_line(entry: dict[str, Any], *, batch_id: str, created: int) -> dict[str, Any]:
    """A stored result or error entry as an OpenAI output / error line."""
    line = entry.get("line")
    request_id = entry.get("job_id") or f"{batch_id}-{line}"
    out: dict[str, Any] = {"id": f"batch_req_{batch_id.removeprefix('batch_')}_{line}",
                           "custom_id": entry.get("custom_id")}
    if "response" in entry:
        body = entry["response"].get("body")
        if entry.get("reply"):
            body = render_reply(entry["reply"], request_id, body or {}, created)
        out["response"] = {"status_code": 200, "request_id": request_id, "body": body}
        out["error"] = None
        return out
    error = entry.get("error") or {}
    code, message = error.get("code", "internal_error"), error.get("message", "failed")
    status = entry.get("status_code")
    if status:
        out["response"] = {"status_code": status, "request_id": request_id,
                           "body": openai_shape(status, code, message, error.get("errors"))}
        out["error"] = None
    else:
        out["response"] = None
        out["error"] = {"code": code, "message": message}
    return out


def render_reply(reply: dict[str, Any], job_id: str, result: dict[str, Any], created: int) -> dict[str, Any]:
    """The job's result as the chat or completions route would have answered it."""
    request = {"token_ids": result.get("prompt_token_ids") or [], "sampling_params": {"n": reply["n"]}}
    job = {"id": job_id, "result": result}
    if reply["url"] == CHAT_URL:
        return openai.chat_reply(reply["body"], request, job, created)
    # completion_reply reads the prompt only to echo it, and the reply keeps it only then.
    return openai.completion_reply({"prompt": "", **reply["body"]}, [request], [job], created)


def render_results(pages: Iterator[list[bytes]], *, batch_id: str, created: int) -> Iterator[bytes]:
    """Stored result pages (JSON bytes per line) as OpenAI JSONL, a page at a time."""
    for page in pages:
        yield b"".join(finite_json.compact(output_line(json.loads(raw), batch_id=batch_id, created=created)).encode()
                       + b"\n" for raw in page)
