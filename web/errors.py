"""The one error handler: every error leaves the API as ``{code, message, errors?}``.

Typed errors (``engine.errors.RolloutError``) carry their own code and status. HTTP errors from
routing and validation get a code from their status. Anything unexpected is logged with its
traceback and answered with a generic 500 — its text never reaches the client.
"""

from __future__ import annotations

import logging

import marshmallow as ma
from flask import Flask, jsonify
from flask_smorest import Api
from kombu.exceptions import OperationalError
from werkzeug.exceptions import HTTPException

import processors.errors  # noqa: F401 - a worker may store these: from_record must know each code here
from domain.error_statuses import http_status
from domain.infra.store_errors import StoreError, StoreFull, StoreUnavailable, store_error
from engine.errors import InternalError, RolloutError
from web.schema_base import Schema
from web.services import services

log = logging.getLogger(__name__)

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "rate_limited",
    500: "internal_error",
    503: "service_unavailable",
}


class ErrorSchema(Schema):
    code = ma.fields.String(required=True, metadata={"description": "Stable machine-readable error code"})
    message = ma.fields.String(required=True)
    errors = ma.fields.Raw(metadata={"description": "Field errors, keyed by field name"})


class ServiceApi(Api):
    """flask-smorest's Api with our error shape for the HTTP errors it raises itself."""

    ERROR_SCHEMA = ErrorSchema

    def handle_http_exception(self, error: HTTPException):
        data = getattr(error, "data", None) or {}
        body = {"code": _HTTP_CODES.get(error.code or 500, "http_error"), "message": data.get("message") or error.description}
        errors = data.get("errors") or data.get("messages")
        if errors:
            # webargs nests body errors under the location ("json"); users see the field names.
            body["errors"] = _json_safe(errors.get("json", errors) if isinstance(errors, dict) else errors)
            body["message"] = data.get("message") or _summarise(body["errors"])
        return body, error.code, data.get("headers", {})


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(RolloutError)
    def handle_rollout_error(error: RolloutError):
        response = jsonify(_json_safe(error.to_dict()))
        response.status_code = http_status(error)
        response.headers.update(error.headers)
        return response

    @app.errorhandler(OperationalError)  # Celery could not publish a message: the broker (Redis) is away
    def handle_broker_error(error: Exception):
        return handle_rollout_error(store_failure(error) or StoreUnavailable())

    @app.errorhandler(Exception)
    def handle_unexpected(error: Exception):
        # HTTP errors never get here: ServiceApi's handler for HTTPException is more specific.
        if (failure := store_failure(error)) is not None:  # a store call's error rose as it was
            return handle_rollout_error(failure)
        log.exception("unexpected error in a view")
        return handle_rollout_error(InternalError("internal error"))


def store_failure(error: BaseException) -> StoreError | None:
    """The domain's typed store error for ``error`` (None when it is none): Redis away is a
    ``redis_unavailable`` 503, a write it refused at its maxmemory the same ``redis_memory_full``
    503 the admission check gives below it."""
    failure = store_error(error, services().redis_memory)
    if isinstance(failure, StoreFull):
        log.warning("redis refused a write: memory full")
    elif failure is not None:
        log.warning("redis unavailable: %s", error.__class__.__name__)
    return failure


def _json_safe(value):
    """Field errors keyed by whatever the client sent (even a nameless form field): string keys."""
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def _summarise(errors) -> str:
    if isinstance(errors, dict):
        return "invalid fields: " + ", ".join(sorted(str(k) for k in errors))
    return "invalid request"
