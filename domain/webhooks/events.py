"""Webhook events: which ends make one, where it goes, its payload, and its states."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from domain.infra import finite_json
from domain.settings import Settings

JOB_EVENTS = ("job.succeeded", "job.failed", "job.cancelled")
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
EVENT_TYPES = {"job": JOB_EVENTS, "batch": BATCH_EVENTS}

# Event states. "pending": no attempt yet; "retrying": the last attempt failed and another is due.
PENDING, RETRYING = "pending", "retrying"
SUCCEEDED, FAILED, GONE, BLOCKED = "succeeded", "failed", "gone", "blocked"
FINAL_STATES = frozenset({SUCCEEDED, FAILED, GONE, BLOCKED})


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
