"""POST /v1/generate: submit a job and wait for it, in our own (native) shape.

The rule: our own shapes live under ``/v1/...`` (jobs, batches, render, generate); a path a
framework's server owns (``/generate`` is SGLang's, ``/inference/v1/generate`` vLLM's,
``/v1/completions`` OpenAI's) speaks exactly that framework's dialect (``web/dialects``).
"""

from __future__ import annotations

from flask import jsonify
from flask.views import MethodView

from domain.jobs.view import public_job
from web.api import idempotency
from web.api.idempotency import answered_job, job_answer, once, replay_headers
from web.api.schemas import JobSchema, SyncGenerateRequestSchema, SyncResultSchema
from web.api.submit import confirm_created, submit
from web.blueprint import Blueprint
from web.dialects.common import job_error
from web.services import services

blp = Blueprint("generate", __name__, description="Synchronous generation in the native shape")


@blp.route("/v1/generate")
class Generate(MethodView):
    @blp.arguments(SyncGenerateRequestSchema)
    @blp.response(200, SyncResultSchema)
    @blp.alt_response(202, schema=JobSchema, description="Still running after `timeout` seconds: poll the job")
    @idempotency.documented(blp)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(413, schema=None, description="Body too large")
    @blp.alt_response(422, schema=None, description="Invalid request, or the job failed on its input")
    @blp.alt_response(429, schema=None, description="Too many unfinished jobs")
    @blp.alt_response(500, schema=None, description="The job failed inside the service")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def post(self, request):
        """Generate (or score) synchronously; answers 202 with the job if it takes longer than `timeout`.
        With an ``Idempotency-Key``, sending it again waits for (and answers) the same job."""
        body = dict(request)
        timeout = request.pop("timeout")
        svc = services()
        made = once("POST /v1/generate", body, lambda: submit(request, confirm=False), job_answer)
        job = answered_job(made)
        confirm_created([job["id"]])
        finished = svc.jobs.wait(job["id"], timeout=min(timeout, svc.settings.sync_timeout_max))
        if finished is None or finished["status"] not in ("succeeded", "cancelled"):
            if finished is not None and finished["status"] == "failed":
                raise job_error(finished)
            # A ready response: the 200 schema must not reshape the job object.
            view = public_job(finished or job)
            response = jsonify(JobSchema().dump(view))
            response.status_code = 202
            response.headers["Location"] = view["links"]["self"]
            response.headers.update(replay_headers(made))
            return response
        result = finished.get("result") or {}
        return {
            "request_id": finished.get("request_id") or None,
            "job_id": finished["id"],
            "prompt_token_ids": result.get("prompt_token_ids"),
            "choices": result.get("choices"),
            "completion_logprobs": result.get("completion_logprobs"),  # kind: "score"
            "prompt_logprobs": result.get("prompt_logprobs"),
            "prompt_top_logprobs": result.get("prompt_top_logprobs"),
            "usage": result.get("usage"),
            "cached_tokens": result.get("cached_tokens"),
            "weight_version": result.get("weight_version"),  # its last token's (choices' weight_versions: all)
            "prompt_logprobs_version": result.get("prompt_logprobs_version"),
        }, 200, replay_headers(made)
