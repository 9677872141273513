"""vLLM's token-in-token-out routes and its RL control routes (pause, resume, abort), with errors
in vLLM's (OpenAI's) shape."""

from __future__ import annotations

from flask import jsonify
from flask.views import MethodView
from marshmallow import EXCLUDE, ValidationError, fields, validate, validates_schema

from domain.weights.updates import fleet_paused
from engine.errors import InvalidRequestError
from web.api.render import render_on_worker
from web.api.schemas import StrictBoolean
from web.api.weights import PAUSE_REPORT_SECONDS
from web.auth import current_owner, require_admin
from web.blueprint import Blueprint
from web.dialects import openai
from web.dialects.abort import abort_jobs
from web.dialects.common import media_url, run_jobs, served_model_name, tokenizer
from web.dialects.errors import install, openai_shape
from web.dialects.openai.stream import GenerateChunks
from web.dialects.openai.views import documented
from web.dialects.streaming import dialect_stream
from web.dialects.vllm import request as vllm
from web.schema_base import Schema
from web.services import services

blp = Blueprint("vllm", __name__, description="vLLM's token-in-token-out API (generate and render)")
install(blp, openai_shape)


@blp.route("/inference/v1/generate")
class Generate(MethodView):
    @blp.arguments(vllm.GenerateRequestSchema)
    @blp.response(200)
    @documented(blp)
    def post(self, body):
        """Token ids (and the features a render returned, or content parts) in, token ids out."""
        request = vllm.generate_request(body)
        if body.get("stream"):
            return dialect_stream([request], GenerateChunks(body, request))
        (job,) = run_jobs([request])
        return vllm.generate_reply(body, request, job)


@blp.route("/v1/chat/completions/render")
class ChatRender(MethodView):
    @blp.arguments(openai.ChatCompletionRequestSchema)
    @blp.response(200)
    @documented(blp)
    def post(self, body):
        """Render a chat request into a generate request: exact prompt ids (media runs expanded)
        and ``features`` to pass back unchanged."""
        openai.check_model(body.get("model"))
        _refuse_unrendered(body)
        svc = services()
        messages = [_with_media_urls(message, i) for i, message in enumerate(body["messages"])]
        rendered = render_on_worker(messages)
        features = vllm.features_of(rendered["token_ids"], rendered["content_parts"], svc.model_facts.image_token_id)
        return {"request_id": body.get("request_id"), "token_ids": rendered["token_ids"], "features": features,
                "sampling_params": vllm.render_sampling(body), "model": served_model_name(), "stream": False}


@blp.route("/v1/completions/render")
class CompletionRender(MethodView):
    @blp.arguments(openai.CompletionRequestSchema)
    @blp.response(200, description="One generate request per prompt")
    @documented(blp)
    def post(self, body):
        """Tokenize completion prompts into generate requests (no media: features null)."""
        openai.check_model(body.get("model"))
        prompts, _ = openai.prompts_of(body["prompt"])
        tok, sampling = tokenizer(), vllm.render_sampling(body)
        out = [{"request_id": body.get("request_id"), "features": None, "sampling_params": sampling,
                "model": served_model_name(), "stream": False,
                "token_ids": prompt if isinstance(prompt, list)
                else tok(prompt, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]}
               for prompt in prompts]
        return jsonify(out)


# What the chat body takes that a render (the model's template with its generation prompt, on a CPU
# worker) does not honour: accepted only at these values, refused by name otherwise.
_RENDER_HONOURS = {"chat_template_kwargs": (None, {}), "add_generation_prompt": (None, True),
                   "stream": (None, False), "tool_choice": (None, "none", "auto"),
                   "tools": (None, []), "parallel_tool_calls": (None, True)}  # render writes no tools


def _refuse_unrendered(body: dict) -> None:
    bad = {name: [f"not honoured by render; leave it out or send {allowed[-1]!r}"]
           for name, allowed in _RENDER_HONOURS.items() if name in body and body[name] not in allowed}
    if bad:
        raise InvalidRequestError("render does not honour these fields", errors=bad)


def _with_media_urls(message: dict, index: int) -> dict:
    """Raw base64 in image_url parts as data: URLs, so render's fetch applies the same caps."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
            url = media_url(part["image_url"].get("url"), f"messages[{index}].content[{j}].image_url.url")
            part = {**part, "image_url": {**part["image_url"], "url": url}}
        parts.append(part)
    return {**message, "content": parts}


# --- vLLM's RL control routes (``vllm/entrypoints/serve/dev/rlhf/api_router.py``) ---------------

# vLLM's pause modes in ours: ``keep`` freezes rows between steps to continue after /resume, under
# the weights an update meanwhile swapped in (workers/gpu/weight_sync.py: HOLDING_MODES).
_PAUSE_MODES = {"abort": "abort", "wait": "finish", "keep": "keep"}


class PauseQuerySchema(Schema):
    class Meta:
        unknown = EXCLUDE

    mode = fields.String(load_default="abort", validate=validate.OneOf(list(_PAUSE_MODES)))
    # Query strings: "true" / "false", as FastAPI reads them.
    wait_for_inflight_requests = fields.Boolean(load_default=False)  # vLLM's older spelling of mode=wait
    clear_cache = fields.Boolean(load_default=True)  # caches keyed by the weights are cleared on a swap anyway


class AbortRequestsSchema(Schema):
    """Which of the caller's jobs to abort: ``request_ids`` (an empty list aborts nothing), or all
    with an explicit ``abort_all: true``. Anything else (a misspelled field, null ids and no
    abort_all) is a 422, never "all"."""

    request_ids = fields.List(fields.String(validate=validate.Length(1, 256)), validate=validate.Length(max=10_000))
    abort_all = StrictBoolean(load_default=False)

    @validates_schema
    def one_target(self, data: dict, **_) -> None:
        if data["abort_all"] and data.get("request_ids"):
            raise ValidationError("give request_ids or abort_all: true, not both", "abort_all")
        if not data["abort_all"] and "request_ids" not in data:
            raise ValidationError("name the jobs: request_ids (a list), or abort_all: true for all of yours",
                                  "request_ids")


@blp.route("/pause")
class Pause(MethodView):
    @blp.arguments(PauseQuerySchema, location="query")
    @blp.response(200, description='{"status": "paused"} once every live GPU worker has seen the pause')
    def post(self, query):
        """Pause generation for a weight update (admin keys): GPU workers take no new work until /resume."""
        require_admin()
        store = services().weight_store
        pause = store.pause("finish" if query["wait_for_inflight_requests"] else _PAUSE_MODES[query["mode"]])
        fleet_paused(store, pause, PAUSE_REPORT_SECONDS)
        return {"status": "paused"}


@blp.route("/resume")
class Resume(MethodView):
    @blp.response(200, description='{"status": "resumed"}')
    def post(self):
        """GPU workers take work again (admin keys)."""
        require_admin()
        services().weight_store.resume()
        return {"status": "resumed"}


@blp.route("/is_paused")
class IsPaused(MethodView):
    @blp.response(200, description='{"is_paused": bool}')
    def get(self):
        """Whether generation is paused."""
        return {"is_paused": services().weight_store.paused() is not None}


@blp.route("/abort_requests")
class AbortRequests(MethodView):
    @blp.arguments(AbortRequestsSchema)
    @blp.response(200, description='{"status": "aborted", "aborted": n}')
    def post(self, body):
        """Abort the caller's own unfinished jobs: those with the given ``request_ids``, or all of
        them with ``abort_all: true``. Each ends with finish_reason abort and its tokens so far."""
        if body["abort_all"]:
            aborted = abort_jobs(current_owner())
        else:
            aborted = abort_jobs(current_owner(), request_ids=set(body["request_ids"])) if body["request_ids"] else 0
        return {"status": "aborted", "aborted": aborted}
