"""Errors answered before the application sees a request: by the event loop that collects it
(``web/serving/request_buffering.py``) or by gunicorn's parser (``web/serving/server.py``), in the API's error
shape (``{"code", "message"}``) rather than HTML.

Hand-written HTTP, as gunicorn's own ``util.write_error`` is, because no request or WSGI response
exists at that point.
"""

from __future__ import annotations

import json
from http import HTTPStatus

# Each status answered before the app, with its code and message ({limit}: the request line's).
EARLY_ERRORS = {
    400: ("bad_request", "the request is not valid HTTP/1.1 (its request line, a header or its body's framing is malformed)"),
    403: ("forbidden", "the request was refused"),
    408: ("request_timeout", "the request did not arrive within {timeout:g} s"),
    414: ("uri_too_long", "the request line is longer than {limit} bytes"),
    417: ("expectation_failed", "the Expect header cannot be met"),
    431: ("headers_too_large", "the request headers are too many or too large"),
    501: ("not_implemented", "the transfer coding is not supported"),
}


def error_response(status: int, status_line: str | None = None, **details) -> bytes:
    """A whole ``Connection: close`` response for ``status``; ``details`` fill the message."""
    code, message = EARLY_ERRORS.get(status, ("internal_error", "internal error"))
    try:
        message = message.format(**details)
    except KeyError:  # a detail this caller does not know: the message as it stands
        pass
    body = json.dumps({"code": code, "message": message}).encode()
    if status_line is None:
        status_line = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"
    head = (f"{status_line}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
    return head + body
