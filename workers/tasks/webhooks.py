"""The webhook tasks (queue ``webhooks``): make one event per object end, deliver it with retries.
Events are made by ``domain.webhooks.emit``.

- ``rollout.webhooks.job_ended(job_id)``: sent by ``domain.lifecycle`` when a job ends. Makes the
  job's event (at most one per job and event type: a second call finds it and only makes sure its
  first attempt runs) and runs attempt 1 itself, so a job's end reaches its receiver in one hop.
- ``rollout.webhooks.deliver(event_id, attempt=1)``: one attempt; a retryable outcome queues the
  next attempt with a countdown. A delivery never touches its job. An attempt whose key already
  holds its share of the delivery threads is parked until one of the key's attempts ends.

Crashes: tasks are acked late, so a worker killed mid-attempt leaves the message to be
redelivered, and a Redis outage puts it back (workers/tasks/outage.py). A redelivered message
sends again with the same ``webhook-id`` (receivers dedupe by it, as the spec asks). Each attempt number is claimed by one Celery message (its task id
survives redelivery), so a duplicated follow-up message cannot start a second retry chain.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from celery import shared_task

from domain.infra.metrics import count
from domain.names import DELIVER_TASK, JOB_ENDED_TASK, WEBHOOKS_QUEUE
from domain.webhooks import (
    FINAL_STATES,
    RETRYING,
    SUCCEEDED,
    retry_delay,
    send_attempt,
)
from domain.webhooks.emit import emit_job_event, queue_attempt
from engine.errors import NotFoundError
from workers.runtime import runtime
from workers.tasks.outage import requeued_while_redis_is_down

log = logging.getLogger(__name__)


@shared_task(name=JOB_ENDED_TASK, bind=True)
def job_ended(self, job_id: str) -> str | None:
    rt = runtime(self.app)
    with requeued_while_redis_is_down(f"the end of job {job_id}'s webhook"):
        try:
            job = rt.jobs.get(job_id)
        except NotFoundError:
            return None  # expired: nothing to report
        return emit_job_event(rt, job, app=self.app, first_attempt=lambda event_id: _deliver(self, event_id, 1))


@shared_task(name=DELIVER_TASK, bind=True)
def deliver(self, event_id: str, attempt: int = 1) -> str | None:
    """Attempt ``attempt`` of the event; the event's state afterwards (None when there is no event)."""
    with requeued_while_redis_is_down(f"webhook {event_id} attempt {attempt}"):
        return _deliver(self, event_id, attempt)


def _deliver(task, event_id: str, attempt: int) -> str | None:
    """One attempt, run by ``task``: a ``deliver`` task, or the ``job_ended`` task for attempt 1
    (its task id claims the attempt, and survives a redelivery as a deliver message's does)."""
    rt = runtime(task.app)
    # A countdown longer than the broker's visibility timeout would be redelivered while it waits
    # (Redis hands unacknowledged messages to another worker): wait in hops, see run_attempt.
    hop = rt.settings.visibility_timeout / 2

    def queue_next(next_attempt: int, countdown: float) -> None:
        queue_attempt(task.app, event_id, next_attempt, countdown=min(countdown, hop))

    owner = rt.webhooks.owner(event_id)
    if owner is None:
        return None  # no such event (expired)
    # Fairness: one key's hanging receivers may hold only its share of the delivery threads; an
    # attempt over the share is parked until one of the key's attempts ends (domain/infra/fair_share.py).
    share, member = rt.share("webhooks"), f"{event_id}:{attempt}"
    if not share.acquire_or_park(owner, member, task=DELIVER_TASK, args=[event_id], kwargs={"attempt": attempt},
                                 queue=WEBHOOKS_QUEUE):
        return None
    try:
        return run_attempt(rt, event_id, attempt, token=task.request.id or uuid.uuid4().hex,
                           queue_next=queue_next)
    finally:
        share.release(owner, member, rt.publish)


def run_attempt(rt, event_id: str, attempt: int, *, token: str,
                queue_next: Callable[[int, float], None]) -> str | None:
    """The body of ``deliver``: claim attempt ``attempt`` for ``token``, send, record, queue the next.

    ``token`` identifies the message (the Celery task id, which a redelivery keeps); ``queue_next``
    queues attempt n after a countdown in seconds.
    """
    store = rt.webhooks
    event = store.get(event_id)
    if event is None or event["state"] in FINAL_STATES:
        return None if event is None else event["state"]
    if event["attempts"] >= attempt:
        # This attempt was sent and recorded before the worker died, maybe before the next one was
        # queued: queue it (again), unless it is already running or done.
        if event["state"] == RETRYING and event["attempts"] == attempt and not store.claimed(event_id, attempt + 1):
            queue_next(attempt + 1, max(0.0, (event["next_attempt_at"] or 0.0) - time.time()))
        return event["state"]
    if event["attempts"] != attempt - 1:
        log.warning("webhook %s: attempt %d out of order (%d recorded); dropped", event_id, attempt,
                    event["attempts"])
        return event["state"]
    not_before = event["next_attempt_at"] or 0.0
    if not_before - time.time() > 1.0:
        queue_next(attempt, not_before - time.time())  # a hop of a long wait: not due yet
        return event["state"]
    if not store.claim(event_id, attempt, token):
        return event["state"]  # another message owns this attempt

    at = time.time()
    outcome, latency = send_attempt(rt.webhook_fetcher, rt.webhook_signer, event)
    schedule = tuple(rt.settings.webhook_retry_schedule)
    delay = retry_delay(attempt, schedule, outcome.retry_after) if outcome.state == RETRYING else None
    state = store.record(event_id, attempt, outcome, latency, at=at, next_delay=delay)
    count(rt.redis, f"webhook_attempts_{state}")
    log_line = "webhook %s attempt %d for %s %s: %s (status %s, error %s)"
    log_args = (event_id, attempt, event["object"], event["object_id"], state, outcome.status_code, outcome.error)
    if state == RETRYING:
        log.info(log_line + ", next in %.1fs", *log_args, delay)
        queue_next(attempt + 1, delay or 0.0)
    elif state == SUCCEEDED:
        log.info(log_line, *log_args)
    else:
        log.warning(log_line, *log_args)
    return state
