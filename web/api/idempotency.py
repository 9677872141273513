"""``Idempotency-Key`` on the native submits (``POST /v1/jobs``, ``/v1/jobs/bulk``, ``/v1/generate``).

A submit with a key makes its jobs once: sent again with the same key and body (a client that met a
closed connection and cannot know whether the first one arrived), it is answered with the jobs the
first one made, ``Idempotent-Replayed: true`` beside them; with another body, 409
``idempotency_key_reused``. Keys are the caller's own: two API keys' equal keys are two submits.
The store is ``domain/jobs/idempotency.py``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from flask import request as http_request

from domain.infra.store_errors import STORE_FAILURES
from domain.jobs.idempotency import Answer, Claim, IdempotencyKeyInUseError, fingerprint
from engine.errors import Fault, RolloutError
from web.auth import current_owner
from web.services import services

log = logging.getLogger(__name__)

HEADER = "Idempotency-Key"
REPLAYED = {"Idempotent-Replayed": "true"}
# Visible ASCII but the quote and the backslash, as Stripe's keys and the IETF draft's sf-string
# (which may come quoted) allow; a UUID fits. No comma either: HTTP lets a server join a field sent
# twice into one value with commas (RFC 9110, section 5.3), as gunicorn and Werkzeug do, so two
# keys would read as one key holding a comma.
_KEY = re.compile(r'[\x21\x23-\x2b\x2d-\x5b\x5d-\x7e]{1,255}')
# How long a submit sent again waits for its first one, still making its jobs, to answer: a submit
# takes milliseconds, so this covers a first one that is slow, not one that died (a 409 then).
IN_USE_WAIT = 5.0

T = TypeVar("T")

# The header in the OpenAPI document of each route that takes it.
OPENAPI_PARAMETERS = [{
    "name": HEADER, "in": "header", "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    "description": "A key of the caller's own (a UUID, say): the submit sent again with it and the same body "
                   "answers what the first one made (Idempotent-Replayed: true); with another body, 409."}]


def documented(blp):
    """A submit route's OpenAPI: the header and the two answers it adds (400, 409), in one place."""
    def decorate(view):
        view = blp.alt_response(409, schema=None, description="The Idempotency-Key came with another body, or its "
                                                              "first submit is still being made")(view)
        view = blp.alt_response(400, schema=None, description="Malformed Idempotency-Key")(view)
        return blp.doc(parameters=OPENAPI_PARAMETERS)(view)

    return decorate


class InvalidIdempotencyKeyError(RolloutError):
    code = "invalid_idempotency_key"
    fault = Fault.MALFORMED


def idempotency_key() -> str | None:
    """The request's key, None without one; :class:`InvalidIdempotencyKeyError` for a malformed one,
    two of them included (WSGI hands the app one value, the fields joined by commas: see _KEY)."""
    value = http_request.headers.get(HEADER)
    if value is None:
        return None
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':  # the draft's structured-field string
        value = value[1:-1]
    if not _KEY.fullmatch(value):
        raise InvalidIdempotencyKeyError(
            f"{HEADER} must be one header of 1 to 255 visible ASCII characters without quotes, backslashes or "
            "commas (a UUID, say)")
    return value


def once(route: str, body: Any, make: Callable[[], T], answer_of: Callable[[T], Answer]) -> T | Answer:
    """``make()`` for a submit without a key, or the first with its key; for a submit sent again
    with the key, the :class:`Answer` the first one recorded (``body``, as validated, and ``route``
    must be the same). ``make`` raising leaves the key free, as nothing was made."""
    key = idempotency_key()
    if key is None:
        return make()
    svc, owner = services(), current_owner()
    store = svc.idempotency
    body_fingerprint = fingerprint(route, body)  # before make: it may fill the body's defaults
    deadline, pause = time.monotonic() + IN_USE_WAIT, 0.005
    while (claim := store.claim(owner, key, body_fingerprint)) is None:
        if time.monotonic() >= deadline:
            raise IdempotencyKeyInUseError(f"the first submit with this {HEADER} is still being made; send it again",
                                           headers={"Retry-After": "1"})
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
    if isinstance(claim, Answer):
        return claim
    try:
        made = make()
    except BaseException:
        _release(store, claim)
        raise
    if not store.answer(claim, answer_of(made)):  # lapsed after CLAIM_TTL: a resend may have made its own
        log.warning("an idempotency claim lapsed before its submit answered")
    return made


def _release(store, claim: Claim) -> None:
    try:
        store.release(claim)
    except STORE_FAILURES:  # Redis away: the claim lapses by itself (CLAIM_TTL)
        pass


def job_answer(job: dict[str, Any]) -> Answer:
    """The answer of a submit that made one job."""
    return Answer((job["id"],))


def answered_job(made: dict[str, Any] | Answer) -> dict[str, Any]:
    """The job a one-job submit made, read again when its answer was replayed."""
    if isinstance(made, Answer):
        return services().jobs.get(made.job_ids[0], owner=current_owner())
    return made


def replay_headers(made: Any) -> dict[str, str]:
    return dict(REPLAYED) if isinstance(made, Answer) else {}
