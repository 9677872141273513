"""Webhook events: build, sign (Standard Webhooks), deliver once, decide the retry, record it.

One *event* is made per object end (a job or a batch reaching a terminal state) and is delivered
in one or more *attempts*. The event's payload is serialised once, when the event is made, and
stored; every attempt sends exactly those bytes, under the same ``webhook-id``. Only
``webhook-timestamp`` and the signatures change per attempt (the spec signs
``id.timestamp.payload``), so a receiver that dedupes by ``webhook-id`` sees one event however many
times it is sent.

Attempt outcomes (``attempt_outcome``):

    2xx                                      succeeded   stop
    410 Gone                                 gone        stop (the receiver unsubscribed)
    429, 5xx, timeout, connection error      retrying    again after a backoff, if any retries left
    3xx (never followed), other 4xx          failed      stop
    refused by the fetch guard               blocked     stop, never retried

Retries follow ``settings.webhook_retry_schedule``: retry *k* waits a random time in
``[0, schedule[k]]`` ("full jitter", so receivers that came back are not hit by every sender at
once), but never less than the receiver's ``Retry-After`` (seconds or an HTTP date, capped at
``RETRY_AFTER_CAP_S``). When the schedule is used up the event is ``failed``.

Redis layout (every key expires with ``settings.result_ttl``):

    rq:webhook:event:<event_id>                 hash: the event (fields in ``EVENT_FIELDS``)
                                                plus ``claim:<n>`` = the task that owns attempt n
    rq:webhook:event:<event_id>:attempts        list: one JSON record per attempt, oldest first
    rq:webhook:events:<object>:<object_id>      list: the object's event ids, oldest first
    rq:webhook:once:<object>:<object_id>:<type> string: the event id (SET NX: one event per end)

The event id is the ``webhook-id`` header (``msg_`` + 128 random bits).
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from standardwebhooks.webhooks import Webhook

from client.retry import parse_retry_after as parse_header
from engine.errors import MediaError
from processors.fetch import (
    FetchPolicy,
    GuardedFetcher,
    MediaBlockedError,
    MediaFetchError,
    MediaRejectedError,
    MediaTimeoutError,
)
from workers import finite_json
from workers.redis_records import decode_record
from workers.settings import Settings

log = logging.getLogger(__name__)

JOB_EVENTS = ("job.succeeded", "job.failed", "job.cancelled")
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
EVENT_TYPES = {"job": JOB_EVENTS, "batch": BATCH_EVENTS}

# Event states. "pending": no attempt yet; "retrying": the last attempt failed and another is due.
PENDING, RETRYING = "pending", "retrying"
SUCCEEDED, FAILED, GONE, BLOCKED = "succeeded", "failed", "gone", "blocked"
FINAL_STATES = frozenset({SUCCEEDED, FAILED, GONE, BLOCKED})

EVENT_FIELDS = ("id", "type", "object", "object_id", "owner", "url", "payload", "state", "attempts",
                "created_at", "next_attempt_at", "completed_at")

# A receiver may ask for a longer pause than our schedule, but not for days.
RETRY_AFTER_CAP_S = 6 * 3600.0
USER_AGENT = "rollout-queue-webhooks"


# --- Keys -----------------------------------------------------------------------------------------

def event_key(event_id: str) -> str:
    return f"rq:webhook:event:{event_id}"


def attempts_key(event_id: str) -> str:
    return f"rq:webhook:event:{event_id}:attempts"


def events_key(object_kind: str, object_id: str) -> str:
    return f"rq:webhook:events:{object_kind}:{object_id}"


def once_key(object_kind: str, object_id: str, event_type: str) -> str:
    return f"rq:webhook:once:{object_kind}:{object_id}:{event_type}"


def new_event_id() -> str:
    return f"msg_{secrets.token_urlsafe(16)}"


# --- What to send, and where ----------------------------------------------------------------------

def wanted(webhook: Mapping[str, Any] | None, event_type: str) -> bool:
    """Whether ``webhook.events`` asks for this event; no list means every terminal event."""
    events = (webhook or {}).get("events")
    return not events or event_type in events


def target_url(webhook: Mapping[str, Any] | None, owner: str | None, settings: Settings) -> str | None:
    """The object's own webhook URL, else the owner's default from ``settings.key_webhooks``."""
    if webhook and webhook.get("url"):
        return webhook["url"]
    return settings.key_webhooks.get(owner or "") or None


def build_payload(event_type: str, data: Mapping[str, Any], *, now: float | None = None) -> str:
    """The event body, serialised once. ASCII-only JSON, so the signed str and the sent bytes agree."""
    stamp = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC)
    body = {"type": event_type, "timestamp": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "data": data}
    return finite_json.dumps(body, separators=(",", ":"), ensure_ascii=True)


class Signer:
    """Standard Webhooks headers for one attempt, signed with every configured secret.

    Several secrets (a rotation in progress) give several space-separated signatures; a receiver
    that knows any one of them verifies. With no secret the headers carry no signature.
    """

    def __init__(self, secrets_: tuple[str, ...]):
        self._webhooks = tuple(Webhook(secret) for secret in secrets_)

    @property
    def signs(self) -> bool:
        return bool(self._webhooks)

    def headers(self, msg_id: str, timestamp: int, payload: str) -> dict[str, str]:
        # The library signs floor(timestamp.replace(tzinfo=utc)): a naive local or non-UTC aware
        # datetime would silently sign another second, so build an aware UTC one here. The payload
        # must be the str: bytes would be signed as "b'...'".
        when = datetime.fromtimestamp(timestamp, tz=UTC)
        headers = {"webhook-id": msg_id, "webhook-timestamp": str(timestamp)}
        if self._webhooks:
            headers["webhook-signature"] = " ".join(w.sign(msg_id, when, payload) for w in self._webhooks)
        return headers


# --- One attempt ----------------------------------------------------------------------------------

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
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or an HTTP date), capped."""
    seconds = parse_header(value, now=now)
    return None if seconds is None else min(seconds, RETRY_AFTER_CAP_S)


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


# --- The guarded fetcher webhooks use -------------------------------------------------------------

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


_fetchers: weakref.WeakKeyDictionary[Any, GuardedFetcher] = weakref.WeakKeyDictionary()
_signers: weakref.WeakKeyDictionary[Any, Signer] = weakref.WeakKeyDictionary()
_warned_unsigned = False


def webhook_fetcher(rt) -> GuardedFetcher:
    """One webhook fetcher per worker runtime (its policy differs from ``rt.fetcher``'s)."""
    fetcher = _fetchers.get(rt)
    if fetcher is None:
        fetcher = _fetchers[rt] = GuardedFetcher(webhook_policy(rt.settings))
    return fetcher


def webhook_signer(rt) -> Signer:
    global _warned_unsigned
    signer = _signers.get(rt)
    if signer is None:
        signer = _signers[rt] = Signer(rt.settings.webhook_secrets)
        if not signer.signs and not _warned_unsigned:
            _warned_unsigned = True
            log.warning("no ROLLOUT_WEBHOOK_SECRETS set: webhooks are sent without a webhook-signature "
                        "header, and receivers cannot tell them from forgeries")
    return signer


# --- Records in Redis -----------------------------------------------------------------------------

# KEYS: once key, event hash, object's event list. ARGV: event id, ttl, then field/value pairs.
# Returns {1, id} when the event was made, {0, existing id} when this end already has one.
_CREATE = """
local existing = redis.call('GET', KEYS[1])
if existing then return {0, existing} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
redis.call('RPUSH', KEYS[3], ARGV[1])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
return {1, ARGV[1]}
"""

# KEYS: event hash. ARGV: attempt number, owner token. Returns 1 when the token owns the attempt:
# it claimed it now, or it claimed it before (the same Celery message, redelivered after a crash).
_CLAIM = """
local field = 'claim:' .. ARGV[1]
if redis.call('HSETNX', KEYS[1], field, ARGV[2]) == 1 then return 1 end
if redis.call('HGET', KEYS[1], field) == ARGV[2] then return 1 end
return 0
"""


class WebhookStore:
    def __init__(self, client: redis.Redis, ttl: int):
        self.redis = client
        self.ttl = ttl
        self._create = client.register_script(_CREATE)
        self._claim = client.register_script(_CLAIM)

    def create(self, *, object_kind: str, object_id: str, owner: str, event_type: str, url: str,
               data: Mapping[str, Any]) -> tuple[str, bool]:
        """Make the event of this end, once: (event id, True) or (the existing id, False)."""
        if event_type not in EVENT_TYPES[object_kind]:
            raise ValueError(f"{event_type!r} is not a {object_kind} event")
        event_id = new_event_id()
        now = time.time()
        fields = {"id": event_id, "type": event_type, "object": object_kind, "object_id": object_id,
                  "owner": owner, "url": url, "payload": build_payload(event_type, data, now=now),
                  "state": PENDING, "attempts": 0, "created_at": now}
        args: list[Any] = [event_id, self.ttl]
        for name, value in fields.items():
            args += [name, value]
        keys = [once_key(object_kind, object_id, event_type), event_key(event_id),
                events_key(object_kind, object_id)]
        made, found = self._create(keys=keys, args=args)
        return found.decode(), made == 1

    def get(self, event_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(event_key(event_id))
        return _decode_event(raw) if raw else None

    def claim(self, event_id: str, attempt: int, token: str) -> bool:
        return self._claim(keys=[event_key(event_id)], args=[attempt, token]) == 1

    def claimed(self, event_id: str, attempt: int) -> bool:
        return bool(self.redis.hexists(event_key(event_id), f"claim:{attempt}"))

    def record(self, event_id: str, attempt: int, outcome: Outcome, latency: float, *,
               at: float, next_delay: float | None) -> str:
        """Append attempt ``attempt`` and move the event to its new state; the new state."""
        if outcome.state == RETRYING and next_delay is None:
            state = FAILED  # out of retries
        else:
            state = outcome.state
        entry = {"attempt": attempt, "at": at, "status_code": outcome.status_code,
                 "latency_ms": round(latency * 1000, 1), "error": outcome.error, "outcome": state}
        fields: dict[str, Any] = {"state": state, "attempts": attempt}
        if state == RETRYING:
            fields["next_attempt_at"] = at + (next_delay or 0.0)
        else:
            fields["next_attempt_at"] = ""
            fields["completed_at"] = at
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(attempts_key(event_id), json.dumps(entry, separators=(",", ":")))
        pipe.hset(event_key(event_id), mapping=fields)
        pipe.expire(attempts_key(event_id), self.ttl)
        pipe.expire(event_key(event_id), self.ttl)
        pipe.execute()
        return state

    def attempts(self, event_id: str) -> list[dict[str, Any]]:
        return [json.loads(item) for item in self.redis.lrange(attempts_key(event_id), 0, -1)]

    def event_ids(self, object_kind: str, object_id: str) -> list[str]:
        return [item.decode() for item in self.redis.lrange(events_key(object_kind, object_id), 0, -1)]

    def deliveries(self, object_kind: str, object_id: str) -> list[dict[str, Any]]:
        """The object's events, oldest first, each with every attempt (what the API shows)."""
        ids = self.event_ids(object_kind, object_id)
        pipe = self.redis.pipeline(transaction=False)
        for event_id in ids:
            pipe.hgetall(event_key(event_id))
            pipe.lrange(attempts_key(event_id), 0, -1)
        replies = pipe.execute()
        views = []
        for raw, attempts in zip(replies[::2], replies[1::2], strict=True):
            if not raw:
                continue  # expired
            event = _decode_event(raw)
            views.append({
                "id": event["id"], "object": "webhook_event", "type": event["type"], "url": event["url"],
                "status": event["state"], "created_at": event["created_at"],
                "completed_at": event["completed_at"], "next_attempt_at": event["next_attempt_at"],
                "attempts": [json.loads(item) for item in attempts],
            })
        return views


def _decode_event(raw: dict[bytes, bytes]) -> dict[str, Any]:
    fields = {key: value for key, value in raw.items() if not key.startswith(b"claim:")}
    return {**dict.fromkeys(EVENT_FIELDS), **decode_record(fields, int_fields=("attempts",))}


def store_for_redis(client: redis.Redis, settings: Settings) -> WebhookStore:
    return WebhookStore(client, settings.result_ttl)


def store_for(rt) -> WebhookStore:
    return store_for_redis(rt.redis, rt.settings)
