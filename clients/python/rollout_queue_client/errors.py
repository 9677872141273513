"""The client's errors. Code branches on the type or on ``code``, never on the message.

    ClientError                 the service answered with an error: ``code``, ``message``, ``status``
    ├── ConnectionFailedError   no answer (refused, reset, timed out); ``status`` is None
    └── WaitTimeoutError        a wait (job, batch, generate) ran out of time; ``status`` is None

``code`` is the service's own error code (``queue_full``, ``invalid_request``, ``not_found``, ...).
A job that ended failed while :meth:`RolloutClient.generate` waited for it raises a
``ClientError`` with the job's error code and ``status`` None.
"""

from __future__ import annotations

from typing import Any


class ClientError(Exception):
    def __init__(self, code: str, message: str, *, status: int | None = None, errors: Any = None,
                 headers: dict[str, str] | None = None):
        super().__init__(f"{code}: {message}" if status is None else f"{status} {code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.errors = errors
        self.headers = headers or {}

    @property
    def retryable(self) -> bool:
        return self.status in (429, 503)


class ConnectionFailedError(ClientError):
    def __init__(self, message: str):
        super().__init__("connection_error", message)


class WaitTimeoutError(ClientError):
    def __init__(self, message: str):
        super().__init__("wait_timeout", message)


def error_from_response(response) -> ClientError:
    """The ClientError for an error response (our JSON shape, or anything a proxy sent)."""
    code, message, errors = f"http_{response.status_code}", response.reason or "error", None
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        code = str(body.get("code") or code)
        message = str(body.get("message") or message)
        errors = body.get("errors")
    return ClientError(code, message, status=response.status_code, errors=errors, headers=dict(response.headers))
