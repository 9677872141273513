"""OpenAI-compatible routes (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``) and
vLLM's ``/tokenize`` / ``/detokenize``, with errors in OpenAI's shape."""

from __future__ import annotations

import time

from flask.views import MethodView
from marshmallow import ValidationError, fields, validate, validates_schema

from engine.errors import InvalidRequestError
from web.api.adapters import visible_adapters
from web.api.schemas import StrictBoolean
from web.blueprint import Blueprint
from web.dialects import chat_template, openai
from web.dialects.common import run_jobs, served_model_name, tokenizer
from web.dialects.errors import install, openai_shape
from web.dialects.fields import NullMeansDefault
from web.dialects.openai.chat_tokens import ChatTokensRequestSchema, chat_tokens_request
from web.dialects.openai.responses_views import responses_routes
from web.dialects.openai.session_turns import HEADER as SESSION_HEADER
from web.dialects.openai.session_turns import SessionTurn, chat_turn
from web.dialects.openai.stream import ChatChunks, CompletionChunks
from web.dialects.openai.tools import checked_tools
from web.dialects.streaming import dialect_stream
from web.services import services

blp = Blueprint("openai", __name__, description="OpenAI-compatible API (with vLLM's extensions)")
install(blp, openai_shape)

_ERRORS = ((401, "Missing or invalid API key"), (404, "No such model"), (413, "Body too large"),
           (422, "Invalid request"), (429, "Too many unfinished jobs"), (503, "Job store unavailable"),
           (504, "Not done within ROLLOUT_SYNC_TIMEOUT_MAX"))


def documented(blueprint, errors=_ERRORS):
    def wrap(view):
        for status, text in errors:
            view = blueprint.alt_response(status, schema=None, description=text)(view)
        return view

    return wrap


@blp.route("/v1/models")
class Models(MethodView):
    @blp.response(200)
    def get(self):
        """The served model, with its context length, and the LoRA adapters this key may use, each
        with the model as its parent (vLLM's listing)."""
        svc = services()
        created, served = int(svc.redis.time()[0]), served_model_name()
        return {"object": "list", "data": [{
            "id": served, "object": "model", "created": created,
            "owned_by": "rollout-queue", "root": served, "parent": None,
            "max_model_len": svc.limits.context_tokens}, *[{
                "id": entry.name, "object": "model", "created": int(entry.loaded_at), "owned_by": "rollout-queue",
                "root": entry.path, "parent": served, "max_model_len": svc.limits.context_tokens}
                for entry in visible_adapters()]]}


@blp.route("/v1/completions")
class Completions(MethodView):
    @blp.arguments(openai.CompletionRequestSchema)
    @blp.response(200)
    @documented(blp)
    def post(self, body):
        """Text completions; each prompt is a job visible in /v1/jobs."""
        requests = openai.completion_requests(body)
        if body.get("stream"):
            return dialect_stream(requests, CompletionChunks(body, requests))
        jobs = run_jobs(requests)
        return openai.completion_reply(body, requests, jobs, int(time.time()))


@blp.route("/v1/chat/completions")
class ChatCompletions(MethodView):
    @blp.arguments(openai.ChatCompletionRequestSchema)
    @blp.response(200)
    @documented(blp)
    def post(self, body):
        """Chat through the model's chat template; media parts go through the guarded fetcher. With
        a session (X-Session-ID or session_id), a turn that extends the last one continues its ids."""
        return _chat(body, *chat_turn(body))


@blp.route("/v1/chat/completions/tokens")
class ChatCompletionsTokens(MethodView):
    @blp.arguments(ChatTokensRequestSchema)
    @blp.response(200)
    @documented(blp)
    def post(self, body):
        """prime-rl's token-in chat: the body's tokens are the prompt; messages and tools drive the reply's parsers."""
        return _chat(body, *chat_tokens_request(body))


def _chat(body: dict, request: dict, turn: SessionTurn | None):
    if body.get("stream"):
        response = dialect_stream([request], ChatChunks(body, [request], session=turn))
        if turn is not None:
            response.headers[SESSION_HEADER] = turn.header()
        return response
    (job,) = run_jobs([request])
    reply = openai.chat_reply(body, request, job, int(time.time()))
    if turn is None:
        return reply
    turn.record(job, request, reply["choices"][0]["message"])
    reply["session"] = turn.reply_field()
    return reply, 200, {SESSION_HEADER: turn.header()}


responses_routes(blp, documented(blp))


class TokenizeSchema(NullMeansDefault):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest (vllm/entrypoints/openai/protocol.py)."""

    model = fields.String()
    prompt = fields.String()
    messages = fields.List(fields.Dict(), validate=validate.Length(min=1, max=1024))
    add_special_tokens = StrictBoolean()
    add_generation_prompt = StrictBoolean()
    return_token_strs = StrictBoolean()
    chat_template_kwargs = fields.Dict(keys=fields.String())
    tools = fields.Raw(metadata={"description": "OpenAI's function tools, rendered by the chat template"})

    @validates_schema
    def one_input(self, data: dict, **_) -> None:
        if ("prompt" in data) == ("messages" in data):
            raise ValidationError("give exactly one of prompt or messages", "prompt")


@blp.route("/tokenize")
class Tokenize(MethodView):
    @blp.arguments(TokenizeSchema)
    @blp.response(200)
    @documented(blp, _ERRORS[:4])
    def post(self, body):
        """Token ids of a prompt, or of chat messages through the chat template (media placeholders
        collapsed, one per item: a job expands them to each item's size)."""
        openai.check_model(body.get("model"))
        tok = tokenizer()
        if "prompt" in body:
            ids = tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        else:
            messages, _ = openai.chat_messages(body["messages"])
            text = chat_template.render(tok, messages, add_generation_prompt=body.get("add_generation_prompt", True),
                                        kwargs=openai.checked_template_kwargs(body),
                                        tools=checked_tools(body, tool_choice=False))
            ids = tok(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"]
        return {"count": len(ids), "max_model_len": services().limits.context_tokens, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None}


class DetokenizeSchema(NullMeansDefault):
    model = fields.String()
    tokens = fields.List(fields.Integer(strict=True, validate=validate.Range(0, 2**31 - 1)), required=True,
                         validate=validate.Length(max=1_000_000))


@blp.route("/detokenize")
class Detokenize(MethodView):
    @blp.arguments(DetokenizeSchema)
    @blp.response(200)
    @documented(blp, _ERRORS[:4])
    def post(self, body):
        """The text of token ids."""
        openai.check_model(body.get("model"))
        tok = tokenizer()
        vocab = len(tok)
        bad = [t for t in body["tokens"] if t >= vocab]
        if bad:
            raise InvalidRequestError(f"token ids out of the vocabulary ({vocab}): {bad[:5]}",
                                             errors={"tokens": ["out of the vocabulary"]})
        return {"prompt": tok.decode(body["tokens"])}


