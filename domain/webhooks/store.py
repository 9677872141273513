"""Webhook events and their attempts in Redis (the layout is in :mod:`domain.webhooks`)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from domain.infra.redis_records import decode_record
from domain.jobs.keys import WEBHOOK_OWED_KEY
from domain.webhooks.attempts import Outcome
from domain.webhooks.events import EVENT_TYPES, FAILED, PENDING, RETRYING, build_payload

EVENT_FIELDS = ("id", "type", "object", "object_id", "owner", "url", "payload", "state", "attempts",
                "created_at", "next_attempt_at", "completed_at")


def event_key(event_id: str) -> str:
    return f"rq:webhook:event:{event_id}"


def attempts_key(event_id: str) -> str:
    return f"rq:webhook:event:{event_id}:attempts"


def events_key(object_kind: str, object_id: str) -> str:
    return f"rq:webhook:events:{object_kind}:{object_id}"


def once_key(object_kind: str, object_id: str, event_type: str) -> str:
    return f"rq:webhook:once:{object_kind}:{object_id}:{event_type}"


OPEN_KEY = "rq:webhook:open"
OWED_KEY = WEBHOOK_OWED_KEY  # written by the script that ends a job (domain/jobs/store.py)
BATCH_OWED_KEY = "rq:webhook:owed:batches"  # written by the move that ends a batch (domain/batches/store.py)


def new_event_id() -> str:
    return f"msg_{secrets.token_urlsafe(16)}"


# KEYS: once key, event hash, object's event list, open events. ARGV: event id, ttl, now, then
# field/value pairs. Returns {1, id} when the event was made, {0, existing id} when this end
# already has one.
_CREATE = """
local existing = redis.call('GET', KEYS[1])
if existing then return {0, existing} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
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


# KEYS: the owed index, then the event hash when one was made. ARGV: the object id.
# Drops the debt only where the event is: a write that went to a primary a split brain later
# discarded (a client's older connection still on it, the next one on the new primary) must not
# take the debt with it from the primary that stays. Returns 1 when settled.
_SETTLE = """
if #KEYS > 1 and redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""


class WebhookStore:
    def __init__(self, client: redis.Redis, ttl: int):
        self.redis = client
        self.ttl = ttl
        self._create = client.register_script(_CREATE)
        self._claim = client.register_script(_CLAIM)
        self._settle = client.register_script(_SETTLE)

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
        args: list[Any] = [event_id, self.ttl, now]
        for name, value in fields.items():
            args += [name, value]
        keys = [once_key(object_kind, object_id, event_type), event_key(event_id),
                events_key(object_kind, object_id), OPEN_KEY]
        made, found = self._create(keys=keys, args=args)
        return found.decode(), made == 1

    def get(self, event_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(event_key(event_id))
        return _decode_event(raw) if raw else None

    def owner(self, event_id: str) -> str | None:
        """The key the event belongs to; None when it expired (one field, not the payload)."""
        owner = self.redis.hget(event_key(event_id), "owner")
        return owner.decode() if owner is not None else None

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
        if state == RETRYING:
            pipe.zadd(OPEN_KEY, {event_id: fields["next_attempt_at"]})
        else:
            pipe.zrem(OPEN_KEY, event_id)
        pipe.execute()
        return state

    # --- what the reaper sweeps (domain/webhooks/reaper.py) ----------------------------------

    def settle(self, job_id: str, event_id: str | None = None) -> bool:
        """The job's event ``event_id`` is made (None: none is wanted after all, or the job
        expired): its debt is dropped, unless the primary does not hold that event (a split brain
        took it). False then: the debt stays for the reaper, which sends the job's end again."""
        return self._settle_debt(OWED_KEY, job_id, event_id)

    def _settle_debt(self, index: str, object_id: str, event_id: str | None) -> bool:
        keys = [index, event_key(event_id)] if event_id else [index]
        return self._settle(keys=keys, args=[object_id]) == 1

    def owed(self, *, before: float, limit: int) -> list[str]:
        """Jobs owed an event since before ``before``, oldest first."""
        return [item.decode() for item in self.redis.zrangebyscore(OWED_KEY, "-inf", before, 0, limit)]

    def settle_batch(self, batch_id: str, event_id: str | None = None) -> bool:
        """``settle`` for an ended batch's event."""
        return self._settle_debt(BATCH_OWED_KEY, batch_id, event_id)

    def owed_batches(self, *, before: float, limit: int) -> list[str]:
        """Ended batches owed an event since before ``before``, oldest first."""
        return [item.decode() for item in self.redis.zrangebyscore(BATCH_OWED_KEY, "-inf", before, 0, limit)]

    def overdue(self, *, before: float, limit: int) -> list[str]:
        """Events not final whose next attempt was due before ``before``, oldest first."""
        return [item.decode() for item in self.redis.zrangebyscore(OPEN_KEY, "-inf", before, 0, limit)]

    def postpone(self, *, owed: Sequence[str] = (), events: Sequence[str] = ()) -> None:
        """Restart the stall clock of owed jobs and open events: a message was found carrying
        them, or was just sent again (so the next sweep looks at the ones behind them)."""
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        if owed:
            pipe.zadd(OWED_KEY, dict.fromkeys(owed, now), xx=True)
        if events:
            pipe.zadd(OPEN_KEY, dict.fromkeys(events, now), xx=True)
        pipe.execute()

    def forget_open(self, event_ids: list[str]) -> None:
        """Drop events from the open index (expired, or final)."""
        if event_ids:
            self.redis.zrem(OPEN_KEY, *event_ids)

    def release_claim(self, event_id: str, attempt: int) -> None:
        """Free attempt ``attempt`` for another message: its own was lost (the reaper checked)."""
        self.redis.hdel(event_key(event_id), f"claim:{attempt}")

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
