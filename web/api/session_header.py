"""An agent's session id from its HTTP request: SkyRL's ``X-Session-ID`` header, on every route,
for the dialects whose bodies have no such field. It routes the agent's turns to one GPU worker
(``domain/infra/gpu_affinity.py``, docs/architecture.md), and on OpenAI chat a turn that extends
the session's last one continues its ids (web/dialects/openai/session_turns.py); the tokens a
given prompt samples never depend on it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from marshmallow import ValidationError

from engine.errors import InvalidRequestError

HEADER = "X-Session-ID"
MAX_LENGTH = 256  # the header's and the body's session_id (web/api/schemas.py)
# One rule for the header and the body's session_id, so one id names one session either way:
# visible ASCII, spaces inside. ASCII because a header's bytes reach the app as latin-1 and a
# body's as Unicode; no space at either end because a header's value comes trimmed.
_SESSION_ID = re.compile(rf"[\x21-\x7e](?:[\x20-\x7e]{{0,{MAX_LENGTH - 2}}}[\x21-\x7e])?")
RULE = f"1 to {MAX_LENGTH} visible ASCII characters (spaces only inside)"


def validate_session_id(value: str) -> None:
    """The body's ``session_id`` (a marshmallow validator): the header's rule."""
    if not _SESSION_ID.fullmatch(value):
        raise ValidationError(RULE)


def with_session(request: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """``request`` with the header's session id, unless its body named one (the body wins)."""
    value = headers.get(HEADER)
    if value is None or "session_id" in request:
        return request
    if not _SESSION_ID.fullmatch(value):
        raise InvalidRequestError(f"{HEADER} must be {RULE}", errors={HEADER: [RULE]})
    return {**request, "session_id": value}


def session_id_of(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The session a dialect body names: its ``session_id`` (checked by its schema), else the
    header's (this rule), else None."""
    return with_session({k: body[k] for k in ("session_id",) if body.get("session_id") is not None},
                        headers).get("session_id")
