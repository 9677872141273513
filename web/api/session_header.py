"""An agent's session id from its HTTP request: SkyRL's ``X-Session-ID`` header, on every route,
for the dialects whose bodies have no such field. It only routes the agent's turns to one GPU
worker (``domain/infra/gpu_affinity.py``, docs/architecture.md); what a request computes never
depends on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.errors import InvalidRequestError

HEADER = "X-Session-ID"
MAX_LENGTH = 256  # the header's and the body's session_id (web/api/schemas.py)


def with_session(request: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """``request`` with the header's session id, unless its body named one (the body wins)."""
    value = headers.get(HEADER)
    if value is None or "session_id" in request:
        return request
    if not 0 < len(value) <= MAX_LENGTH or not value.isprintable():
        raise InvalidRequestError(f"{HEADER} must be 1 to {MAX_LENGTH} printable characters",
                                  errors={HEADER: [f"1 to {MAX_LENGTH} printable characters"]})
    return {**request, "session_id": value}
