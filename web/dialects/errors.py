"""Errors in each dialect's own shape, for the routes of that dialect's blueprint.

The app's handler (``web.errors``) answers ``{code, message, errors}``; a dialect blueprint
installs these handlers instead, so its clients parse errors the way their servers send them.
Statuses and stable codes stay ours; unexpected errors are logged and never show their text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flask import jsonify
from kombu.exceptions import OperationalError
from werkzeug.exceptions import HTTPException

from domain.error_statuses import http_status
from domain.infra.store_errors import StoreUnavailable
from engine.errors import InternalError, RolloutError
from web.errors import _HTTP_CODES, _json_safe, store_failure

log = logging.getLogger(__name__)

Shape = Callable[[int, str, str, Any], dict]

# OpenAI's error types by status (https://platform.openai.com/docs/guides/error-codes).
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
                 429: "rate_limit_error", 504: "timeout_error"}


def openai_shape(status: int, code: str, message: str, errors: Any) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``: OpenAI's, and vLLM's ErrorResponse
    (vllm/entrypoints/openai/engine/protocol.py) has the same keys."""
    param = None
    if isinstance(errors, dict):
        # Field errors are keyed by field; an error about one field's value names it in ``field``.
        param = errors["field"] if isinstance(errors.get("field"), str) else next(iter(errors), None)
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sglang_shape(status: int, code: str, message: str, errors: Any) -> dict:
    """SGLang's http_server answers a failed /generate with ``{"error": {"message": ...}}``
    (python/sglang/srt/entrypoints/http_server.py); the code and field errors ride along."""
    body: dict[str, Any] = {"message": message, "code": code}
    if errors:
        body["errors"] = errors
    return {"error": body}


def flatten(messages: Any, prefix: str = "") -> dict[str, Any]:
    """marshmallow's nested field messages as dotted paths (``sampling_params.regex``), so the
    message and OpenAI's ``param`` name the field itself."""
    if not isinstance(messages, dict):
        return {prefix.rstrip(".") or "_schema": messages}
    flat: dict[str, Any] = {}
    for key, value in messages.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def install(blueprint, shape: Shape) -> None:
    def answer(status: int, code: str, message: str, errors: Any = None, headers: dict | None = None):
        response = jsonify(_json_safe(shape(status, code, message, errors)))
        response.status_code = status
        response.headers.update(headers or {})
        return response

    @blueprint.errorhandler(RolloutError)
    def rollout_error(error: RolloutError):
        return answer(http_status(error), error.code, error.message, error.errors, error.headers)

    @blueprint.errorhandler(HTTPException)
    def http_error(error: HTTPException):
        data = getattr(error, "data", None) or {}
        errors = data.get("messages") or data.get("errors")
        if isinstance(errors, dict):
            errors = flatten(errors.get("json", errors))
        status = error.code or 500
        message = data.get("message") or error.description or "error"
        if isinstance(errors, dict) and errors:
            message = "invalid fields: " + ", ".join(sorted(str(key) for key in errors))
        return answer(status, _HTTP_CODES.get(status, "http_error"), message, errors, data.get("headers"))

    @blueprint.errorhandler(OperationalError)  # Celery could not publish a message: the broker (Redis) is away
    def broker_error(error: Exception):
        return rollout_error(store_failure(error) or StoreUnavailable())

    @blueprint.errorhandler(Exception)
    def unexpected(error: Exception):
        if (failure := store_failure(error)) is not None:  # a store call's error rose as it was
            return rollout_error(failure)
        log.exception("unexpected error in a dialect view")
        return rollout_error(InternalError("internal error"))
