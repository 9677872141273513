"""Webhook events: build, sign (Standard Webhooks), deliver once, decide the retry, record it.

Modules: ``events`` (which ends make an event, where it goes, its payload and states),
``signing`` (the headers of one attempt), ``attempts`` (send once, what the outcome means, the
guarded fetcher's policy for receivers), ``store`` (events and attempts in Redis).

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
    rq:webhook:open                             zset: events not final -> when their next attempt is due
    rq:webhook:owed                             zset: ended jobs whose event is not made yet -> since when

The last two are what ``domain/webhooks/reaper.py`` sweeps for work whose message a crash lost.

The event id is the ``webhook-id`` header (``msg_`` + 128 random bits).
"""

from domain.webhooks.attempts import (
    RETRY_AFTER_CAP_S,
    USER_AGENT,
    Outcome,
    outcome_of_error,
    outcome_of_status,
    parse_retry_after,
    retry_delay,
    send_attempt,
    webhook_policy,
)
from domain.webhooks.events import (
    BATCH_EVENTS,
    BLOCKED,
    EVENT_TYPES,
    FAILED,
    FINAL_STATES,
    GONE,
    JOB_EVENTS,
    PENDING,
    RETRYING,
    SUCCEEDED,
    build_payload,
    target_url,
    wanted,
)
from domain.webhooks.signing import Signer
from domain.webhooks.store import (
    EVENT_FIELDS,
    WebhookStore,
    attempts_key,
    event_key,
    events_key,
    new_event_id,
    once_key,
)

__all__ = [
    "BATCH_EVENTS", "BLOCKED", "EVENT_FIELDS", "EVENT_TYPES", "FAILED", "FINAL_STATES", "GONE", "JOB_EVENTS",
    "PENDING", "RETRYING", "RETRY_AFTER_CAP_S", "SUCCEEDED", "USER_AGENT", "Outcome", "Signer", "WebhookStore",
    "attempts_key", "build_payload", "event_key", "events_key", "new_event_id", "once_key", "outcome_of_error",
    "outcome_of_status", "parse_retry_after", "retry_delay", "send_attempt", "target_url", "wanted",
    "webhook_policy",
]
