"""Making a job's or a batch's webhook event (once per end) and starting its first delivery
attempt. A job's event is made by the ``job_ended`` task, which then runs attempt 1 itself (one
Celery hop from a job's end to its first delivery); a batch's is made where its last line is
counted (``domain.batches.progress``, any worker), which queues attempt 1. The attempts themselves
run in ``workers.tasks.webhooks``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import current_app

from domain.infra.replication import NotDurableError, confirm_if_asked
from domain.jobs.store import TERMINAL
from domain.jobs.view import public_job
from domain.names import DELIVER_TASK, WEBHOOKS_QUEUE
from domain.webhooks import BATCH_EVENTS, PENDING, target_url, wanted

log = logging.getLogger(__name__)


def emit_job_event(rt, job: dict[str, Any], *, app=None,
                   first_attempt: Callable[[str], Any] | None = None) -> str | None:
    """Make (once) the event of a job's end and start its first attempt: ``first_attempt(event_id)``
    when given (the caller runs it), else a queued delivery. Its event id, or None when none is
    wanted."""
    if job["status"] not in TERMINAL:
        log.warning("job %s: no webhook for non-terminal status %s", job["id"], job["status"])
        return None
    event_type = f"job.{job['status']}"
    event_id = _emit(rt, app, "job", job["id"], job.get("owner") or "", job.get("webhook"), event_type,
                     public_job(job), first_attempt)
    # Made (the open events index has it now), or none wanted.
    if not rt.webhooks.settle(job["id"], event_id):
        log.warning("job %s: its webhook event %s is not on the primary (a failover took it); the reaper "
                    "sends the job's end again", job["id"], event_id)
    return event_id


def emit_batch_event(rt, batch: dict[str, Any], event_type: str, *, app=None) -> str | None:
    """Make (once) and queue a batch's terminal event; its event id, or None when none is wanted.

    ``batch`` is the public batch object (sent as the payload's ``data``). Its owner and webhook
    are read from the object, else from the batch record. Safe to call more than once per end.
    """
    if event_type not in BATCH_EVENTS:
        raise ValueError(f"{event_type!r} is not a batch event")
    owner, webhook = batch.get("owner"), batch.get("webhook")
    if owner is None or webhook is None:
        stored_owner, stored_webhook = rt.batches.owner_and_webhook(batch["id"])
        owner = owner if owner is not None else stored_owner or ""
        if webhook is None:
            webhook = stored_webhook or None
    event_id = _emit(rt, app, "batch", batch["id"], owner or "", webhook, event_type, batch, None)
    if not rt.webhooks.settle_batch(batch["id"], event_id):  # as for a job's
        log.warning("batch %s: its webhook event %s is not on the primary (a failover took it); the batches "
                    "reaper makes it again", batch["id"], event_id)
    return event_id


def _emit(rt, app, object_kind: str, object_id: str, owner: str, webhook: dict | None, event_type: str,
          data: dict[str, Any], first_attempt: Callable[[str], Any] | None) -> str | None:
    if not wanted(webhook, event_type):
        return None
    url = target_url(webhook, owner, rt.settings)
    if not url:
        return None
    store = rt.webhooks
    event_id, made = store.create(object_kind=object_kind, object_id=object_id, owner=owner,
                                  event_type=event_type, url=url, data=data)
    if made:
        log.info("%s %s: webhook event %s (%s) made", object_kind, object_id, event_id, event_type)
        _confirm_replicated(rt, event_id)
    else:
        # Already made: a redelivered or repeated call. Start the first attempt again only if it
        # may have been lost (the call that made the event died before starting it); a duplicate is
        # harmless, since attempt 1 can be claimed once.
        event = store.get(event_id)
        if event is None or event["state"] != PENDING or store.claimed(event_id, 1):
            return event_id
    if first_attempt is not None:
        first_attempt(event_id)
    else:
        queue_attempt(app or getattr(rt, "celery", None), event_id, 1, countdown=0)
    return event_id


def queue_attempt(app, event_id: str, attempt: int, *, countdown: float) -> None:
    (app or current_app).send_task(DELIVER_TASK, args=[event_id], kwargs={"attempt": attempt},
                                   queue=WEBHOOKS_QUEUE, countdown=countdown)


def _confirm_replicated(rt, event_id: str) -> None:
    """With ``ROLLOUT_REDIS_REPLICA_ACKS``, the replicas hold the event before a receiver can have
    it: a failover right after its first delivery then cannot lose it, and the end that made it,
    run again, finds it instead of making another under a new ``webhook-id``."""
    try:
        confirm_if_asked(rt, event_id)
    except NotDurableError as error:
        # Delivered anyway: a receiver gets its event at least once, which waiting cannot promise.
        log.warning("webhook event %s: %s", event_id, error)
