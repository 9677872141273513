"""Long polling: a read that waits (``?wait=S``) answers when its record ends or after S seconds,
one request where polling takes one per interval (as SQS's and Google's long-running operations'
``wait`` do). The waiting itself is ``workers.infra.wakeups``."""

from __future__ import annotations

from marshmallow import fields, validate

from web.services import services


def wait_field(what: str) -> fields.Float:
    """The ``wait`` parameter of a read that waits for ``what`` to end."""
    return fields.Float(validate=validate.Range(min=0, min_inclusive=True), metadata={
        "description": f"Seconds to wait for {what} to end before answering (long polling; waits "
                       "past ROLLOUT_SYNC_TIMEOUT_MAX end there). Absent or 0: answer at once."})


def bounded_wait(requested: float) -> float:
    """The seconds to wait: as asked, up to ROLLOUT_SYNC_TIMEOUT_MAX. Bounded, not refused: a client
    cannot know the service's maximum, and an early answer with the record still running is what a
    long poll may always give (the client asks again)."""
    return min(requested, services().settings.sync_timeout_max)
