"""The Flask app factory."""

from __future__ import annotations

import logging

from flask import Flask, g, request

from domain.settings import Settings, load_settings
from engine.errors import PayloadTooLargeError
from web import health, metrics
from web.api import adapters, batches, deliveries, files, generate, jobs, render, sessions, weights
from web.api.batch_upload import MULTIPART_OVERHEAD
from web.dialects.openai import views as openai_views
from web.dialects.sglang import lora as sglang_lora
from web.dialects.sglang import views as sglang_views
from web.dialects.vllm import lora as vllm_lora
from web.dialects.vllm import views as vllm_views
from web.errors import ServiceApi, register_error_handlers
from web.services import Services
from web.serving.body_limit import BoundedRequest
from web.serving.json_body import JsonProvider

log = logging.getLogger(__name__)

# Endpoints anyone may call: probes and the API description.
PUBLIC_ENDPOINTS = {"health.Health", "api-docs.openapi_json", "metrics.metrics", "static"}


def create_app(settings: Settings | None = None, redis_url: str | None = None) -> Flask:
    settings = settings or load_settings()
    redis_url = redis_url or settings.redis_target
    if not redis_url:
        raise ValueError("the API needs ROLLOUT_REDIS_URL (rollout-queue up sets it for you)")
    app = Flask("rollout_queue")
    app.request_class = BoundedRequest
    app.json = JsonProvider(app)
    app.config.update(
        API_TITLE="Rollout Queue",
        API_VERSION="v1",
        OPENAPI_VERSION="3.0.3",
        OPENAPI_URL_PREFIX="/",
        OPENAPI_JSON_PATH="openapi.json",
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        JSON_SORT_KEYS=False,
    )
    svc = Services(settings, redis_url)
    app.extensions["rollout"] = svc
    api = ServiceApi(app, spec_kwargs={
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    })
    for blueprint in (jobs.blp, batches.blp, files.blp, deliveries.blp, generate.blp, render.blp, health.blp, weights.blp, sessions.blp,
                      sglang_views.blp, openai_views.blp, vllm_views.blp, adapters.blp, vllm_lora.blp,
                      sglang_lora.blp):
        api.register_blueprint(blueprint)
    app.register_blueprint(metrics.blp)
    register_error_handlers(app)

    @app.before_request
    def authenticate():
        # Batch uploads have their own, larger cap (checked by that view).
        cap = (settings.batch_max_bytes + MULTIPART_OVERHEAD
               if request.endpoint in ("batches.Batches", "files.Files") else settings.max_body_bytes)
        if request.content_length is not None and request.content_length > cap:
            raise PayloadTooLargeError(f"request body exceeds {cap} bytes")
        if request.endpoint not in PUBLIC_ENDPOINTS:
            g.owner = svc.keys.authenticate()

    if svc.keys.open:
        log.warning("no ROLLOUT_API_KEYS set: the API is open to anyone who can reach it")
        if settings.weights_root is not None:
            log.warning("no ROLLOUT_ADMIN_KEYS set: anyone who can reach the API may update the weights and pause "
                        "generation (model directories under %s)", settings.weights_root)
    elif not settings.admin_keys:
        log.info("no ROLLOUT_ADMIN_KEYS set: weight updates and pausing are refused for every key")
    return app
