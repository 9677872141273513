"""Long polling: a read that waits (``?wait=S``) answers when its record ends or after S seconds,
one request where polling takes one per interval (as SQS's and Google's long-running operations'
``wait`` do). The waiting itself is ``domain.infra.wakeups`` (an API process's waits share one
BLPOP: ``domain/infra/wakeup_hub.py``).

A waiting read holds one of the API process's request threads. One key may hold at most half of
them in long polls (:class:`web.serving.wait_slots.WaitSlots`); its next long poll answers at once, as a long poll may
always answer early, so another key's requests (and ``/healthz``) still find threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from marshmallow import fields, validate

from web.auth import current_owner
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


@contextmanager
def long_wait(requested: float) -> Iterator[float]:
    """The seconds this read may wait (:func:`bounded_wait`), or 0 while its key holds its share of
    the process's waiting threads; the share is held until the block ends."""
    wait = bounded_wait(requested)
    svc, owner = services(), current_owner()
    if not wait or not svc.wait_slots.take(owner):
        yield 0.0
        return
    try:
        yield wait
    finally:
        svc.wait_slots.give_back(owner)
