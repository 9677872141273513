"""One delivery attempt: send the stored payload through the guarded fetcher, and what its
outcome means (stop, or retry after a backoff); the table is in :mod:`domain.webhooks`."""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any

from domain.settings import Settings
from domain.webhooks.events import BLOCKED, FAILED, GONE, RETRYING, SUCCEEDED
from domain.webhooks.signing import Signer
from engine.errors import MediaError
from processors.fetch import (
    FetchPolicy,
    GuardedFetcher,
    MediaBlockedError,
    MediaFetchError,
    MediaRejectedError,
    MediaTimeoutError,
)

log = logging.getLogger(__name__)

# A receiver may ask for a longer pause than our schedule, but not for days.
RETRY_AFTER_CAP_S = 6 * 3600.0
USER_AGENT = "rollout-queue-webhooks"
_SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")  # delta-seconds (a fraction tolerated)


@dataclass(frozen=True)
class Outcome:
    state: str  # SUCCEEDED | RETRYING | FAILED | GONE | BLOCKED
    status_code: int | None
    error: str | None  # a stable code; None on success
    retry_after: float | None = None  # seconds the receiver asked us to wait


def outcome_of_status(status: int, headers: Mapping[str, str], *, now: float) -> Outcome:
    if 200 <= status < 300:
        return Outcome(SUCCEEDED, status, None)
    if status == 410:
        return Outcome(GONE, status, "webhook_gone")
    if status == 429 or status >= 500:
        retry_after = parse_retry_after(_header(headers, "retry-after"), now=now)
        code = "webhook_rate_limited" if status == 429 else "webhook_server_error"
        return Outcome(RETRYING, status, code, retry_after)
    if 300 <= status < 400:
        return Outcome(FAILED, status, "webhook_redirect_not_followed")
    return Outcome(FAILED, status, "webhook_rejected")


# The guarded fetcher's errors, as webhook attempt codes: a media code in a delivery record would
# send its reader looking at media. Most specific first.
_ATTEMPT_ERRORS: tuple[tuple[type[MediaError], str], ...] = (
    (MediaBlockedError, "webhook_blocked"),
    (MediaTimeoutError, "webhook_timeout"),
    (MediaRejectedError, "webhook_unreachable"),  # TLS did not verify, or the host name does not exist
    (MediaFetchError, "webhook_connection_failed"),
    (MediaError, "webhook_failed"),
)


def outcome_of_error(exc: BaseException) -> Outcome:
    code = next((code for kind, code in _ATTEMPT_ERRORS if isinstance(exc, kind)), None)
    if isinstance(exc, MediaBlockedError):
        return Outcome(BLOCKED, None, code)
    if isinstance(exc, MediaError):
        # Timeouts and connection errors are retryable; a TLS failure (MediaRejectedError) is not.
        return Outcome(RETRYING if exc.retryable else FAILED, None, code)
    return Outcome(RETRYING, None, "internal_error")


def parse_retry_after(value: str | None, *, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (RFC 9110, 10.2.3: delta-seconds, or an HTTP
    date the standard library reads), capped; None when absent or unreadable ("nan" included)."""
    value = (value or "").strip()
    if _SECONDS.fullmatch(value):
        return min(float(value), RETRY_AFTER_CAP_S)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # HTTP dates are GMT
        when = when.replace(tzinfo=UTC)
    return min(max(when.timestamp() - now, 0.0), RETRY_AFTER_CAP_S)


def retry_delay(attempt: int, schedule: tuple[float, ...], retry_after: float | None = None,
                rng: random.Random | None = None) -> float | None:
    """Seconds to wait after failed attempt number ``attempt`` (1-based); None when out of retries."""
    if attempt > len(schedule):
        return None
    delay = (rng or random).uniform(0.0, float(schedule[attempt - 1]))
    return max(delay, retry_after) if retry_after is not None else delay


def send_attempt(fetcher: GuardedFetcher, signer: Signer, event: Mapping[str, Any]) -> tuple[Outcome, float]:
    """POST the stored payload once; the outcome and the latency in seconds. Never raises."""
    payload: str = event["payload"]
    headers = signer.headers(event["id"], int(time.time()), payload)
    headers.update({"Content-Type": "application/json", "User-Agent": USER_AGENT})
    started = time.monotonic()
    try:
        response = fetcher.post(event["url"], payload.encode("ascii"), headers)
    except MediaError as exc:
        return outcome_of_error(exc), time.monotonic() - started
    except Exception as exc:  # a bug in the send path: logged, recorded, retried like a 5xx
        log.exception("webhook %s: unexpected error while sending", event["id"])
        return outcome_of_error(exc), time.monotonic() - started
    return outcome_of_status(response.status, response.headers, now=time.time()), response.elapsed


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def webhook_policy(settings: Settings) -> FetchPolicy:
    """The media policy's address and port rules, without its domain list, under the webhook timeout.

    ``allowed_media_domains`` says where media may come from, not where owners may be called back,
    so it does not apply; the address rules (no loopback/private/link-local unless
    ``outbound_allow_networks`` lifts them) and the port list do. One POST, no retries inside it:
    retrying is this module's job.
    """
    return FetchPolicy(
        allow_networks=settings.outbound_allow_networks,
        allowed_ports=settings.outbound_allowed_ports,
        connect_timeout=min(settings.fetch_connect_timeout, settings.webhook_timeout),
        total_timeout=settings.webhook_timeout,
        retries=0,
    )
