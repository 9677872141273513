"""SGLang's routes: ``POST /generate`` and the small routes its routers and trainers call
(``/health``, ``/health_generate``, ``/get_model_info``, ``/get_server_info``, ``/flush_cache``,
``/abort_request``), as sglang's ``python/sglang/srt/entrypoints/http_server.py`` serves them."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from flask import jsonify
from flask.views import MethodView
from marshmallow import fields, validate

from domain.infra.heartbeats import alive_workers
from domain.models import model_id
from engine.errors import ServiceUnavailableError
from web.api.schemas import NumberList, StrictBoolean
from web.auth import current_owner, require_admin
from web.blueprint import Blueprint
from web.dialects.abort import abort_jobs
from web.dialects.common import native_request, run_jobs, served_model_name
from web.dialects.errors import install, sglang_shape
from web.dialects.sglang import request as sglang
from web.dialects.sglang.stream import SglangChunks
from web.dialects.streaming import dialect_stream
from web.schema_base import Schema
from web.services import services
from workers.gpu.model_check import last_model_check

blp = Blueprint("sglang", __name__, description="SGLang's native API (/generate and its small routes)")
install(blp, sglang_shape)

_ERRORS = ((401, "Missing or invalid API key"), (413, "Body too large"), (422, "Invalid request"),
           (429, "Too many unfinished jobs"), (503, "Job store unavailable"),
           (504, "Not done within ROLLOUT_SYNC_TIMEOUT_MAX"))


def _documented(view):
    for status, text in _ERRORS:
        view = blp.alt_response(status, schema=None, description=text)(view)
    return view


class GenerateReplySchema(Schema):
    text = fields.String()
    output_ids = NumberList(fields.Integer())
    meta_info = fields.Dict(metadata={"description": "id, finish_reason, prompt_tokens, completion_tokens, "
                                                     "cached_tokens, output_token_logprobs, weight_version, "
                                                     "e2e_latency, job_id, ..."})


@blp.route("/generate")
class Generate(MethodView):
    @blp.arguments(sglang.SglangGenerateSchema)
    @blp.response(200, GenerateReplySchema, description="One reply, or a list for a batch or n > 1")
    @_documented
    def post(self, body):
        """SGLang's GenerateReqInput in, its reply out; each prompt is a job visible in /v1/jobs."""
        svc = services()
        requests, options, batch = sglang.to_requests(body, vocab_size=svc.model_facts.vocab_size)
        if body.get("stream"):
            return dialect_stream(requests, SglangChunks(requests, options, batch,
                                                         bool(body.get("return_text_in_logprobs"))))
        jobs = run_jobs(requests)
        out = sglang.replies(requests, options, jobs, return_text=bool(body.get("return_text_in_logprobs")))
        # A ready response: the 200 schema describes one reply, and a batch is a list of them.
        return jsonify(out if batch or len(out) != 1 else out[0])


@blp.route("/health")
class Health(MethodView):
    @blp.response(200, description="The API and the job store are up")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self):
        """SGLang's liveness probe (needs the key like every route here; /healthz does not)."""
        services().redis.ping()
        return ""


@blp.route("/health_generate")
class HealthGenerate(MethodView):
    @blp.response(200, description="A one-token job went through the whole service")
    @blp.alt_response(503, schema=None, description="No GPU worker generated it")
    def get(self):
        """Generate one token as a real job (visible in /v1/jobs), as SGLang's probe does."""
        facts = services().model_facts
        token = next(t for t in range(facts.vocab_size or 1) if t not in facts.media_token_ids)
        request = native_request({"token_ids": [token], "sampling_params": {"max_tokens": 1}})
        (job,) = run_jobs([request])
        if job["status"] != "succeeded":
            raise ServiceUnavailableError("the health job did not succeed")
        return ""


@blp.route("/get_model_info")
class ModelInfo(MethodView):
    @blp.response(200)
    def get(self):
        """The served model, as SGLang's /get_model_info names it."""
        svc = services()
        return {"model_path": model_id(svc.settings), "tokenizer_path": model_id(svc.settings),
                "served_model_name": served_model_name(), "is_generation": True,
                "preferred_sampling_params": None, "weight_version": _weight_version(),
                "max_model_len": svc.limits.context_tokens, "model_check": last_model_check(svc.redis)}


@blp.route("/get_server_info")
class ServerInfo(MethodView):
    @blp.response(200)
    def get(self):
        """Server settings a trainer reads (a subset of SGLang's ServerArgs dump)."""
        svc = services()
        return {"model_path": model_id(svc.settings), "served_model_name": served_model_name(),
                "context_length": svc.limits.context_tokens, "weight_version": _weight_version(),
                "version": _version(), "max_running_requests": svc.settings.batch_rows,
                "sync_timeout_max": svc.settings.sync_timeout_max}


@blp.route("/flush_cache")
class FlushCache(MethodView):
    @blp.response(200, description="The multimodal cache is empty")
    def post(self):
        """Empty the multimodal cache (Redis, and this API process's memory): admin keys only, since
        it holds every key's entries (a key's uuid-only requests need its own). Workers keep at most
        ROLLOUT_MM_CACHE_PROCESS_BYTES of recent entries in memory until they restart."""
        require_admin()
        cache = services().mm_cache
        if cache is not None:
            cache.clear()
        return "Cache flushed.\n"


class AbortRequestSchema(Schema):
    rid = fields.String(load_default="", validate=validate.Length(max=256))
    abort_all = StrictBoolean(load_default=False)
    abort_message = fields.String(allow_none=True)


@blp.route("/abort_request")
class AbortRequest(MethodView):
    @blp.arguments(AbortRequestSchema)
    @blp.response(200, description="The caller's matching unfinished jobs are aborted")
    def post(self, body):
        """Abort the caller's own unfinished jobs: with ``rid``, those with that request id; with
        ``abort_all``, all of them. Each ends with finish_reason abort and its tokens so far."""
        if body["abort_all"]:
            abort_jobs(current_owner())
        elif body["rid"]:
            abort_jobs(current_owner(), request_ids={body["rid"]})
        return ""


def _weight_version() -> str | None:
    """The fleet's target version (POST /v1/weights), else what a live GPU worker serves."""
    target = services().weight_store.target()
    if target is not None:
        return target.version
    gpu = alive_workers(services().redis).get("gpu") or {}
    return gpu.get("weight_version") or services().settings.weight_version


def _version() -> str:
    try:
        return version("rollout-queue")
    except PackageNotFoundError:
        return "0"
