"""The HTTP status each kind of error answers with: what the API responds and what an OpenAI batch
output line records as the status its request would have had. Errors name their kind
(``engine.errors.Fault``) and no protocol; this is the one place that turns a kind into a status."""

from __future__ import annotations

from engine.errors import Fault, RolloutError

HTTP_STATUS: dict[Fault, int] = {
    Fault.MALFORMED: 400,
    Fault.INVALID: 422,
    Fault.UNAUTHENTICATED: 401,
    Fault.FORBIDDEN: 403,
    Fault.NOT_FOUND: 404,
    Fault.CONFLICT: 409,
    Fault.GONE: 410,
    Fault.TOO_LARGE: 413,
    Fault.RATE_LIMITED: 429,
    Fault.CANCELLED: 499,  # nginx's status for a client that closed first; no standard one exists
    Fault.UNAVAILABLE: 503,
    Fault.DEADLINE_EXCEEDED: 504,
    Fault.INTERNAL: 500,
}


def http_status(error: RolloutError) -> int:
    return HTTP_STATUS[error.fault]
