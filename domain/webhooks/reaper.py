"""Webhooks whose message a crash lost, sent again (how: ``domain/infra/lost_messages.py``).

A job's end reaches its receiver through two kinds of messages, either of which a crash can lose in
kombu's pop-before-record gap: the job's ``job_ended`` (which makes the event and runs attempt 1),
and each later ``deliver`` (a retry, or an attempt parked by the key's delivery share). The webhook
store indexes both debts (``WebhookStore.owed``: ended jobs whose event is not made yet, recorded by
the script that ends the job; ``WebhookStore.overdue``: events not final, by when their next attempt
is due). Those older than ``stall_s`` are looked for in the webhooks queue, kombu's unacknowledged
messages (where a retry waiting for its countdown sits) and the webhook share's parked and waking
entries. One lost gets its message again: ``job_ended`` for an owed job, ``deliver`` of the next
attempt for an event (the lost message's claim on that attempt is released first, or the new message
could not take it). A batch's event is covered once made; a batch whose end made no event is owed
one by the move that ended it, and the batches worker's sweep makes it
(``domain/batches/reaper.py``).
"""

from __future__ import annotations

import logging
import re
import threading
import time

from domain.infra.lost_messages import Suspects, ids_in_messages, start_sweeping, sweep_every
from domain.names import JOB_ENDED_TASK, WEBHOOKS_QUEUE
from domain.webhooks import FINAL_STATES
from domain.webhooks.emit import queue_attempt

log = logging.getLogger(__name__)

# Job and event ids (domain.jobs.store.new_id, domain.webhooks.store.new_event_id) in messages.
_IDS = re.compile(rb"(?:job|msg)_[A-Za-z0-9_-]{22}")
SUSPECTS_KEY = "rq:webhook:suspects"
MAX_CANDIDATES = 1000


class WebhookReaper:
    """``rt``: a worker's runtime (``webhooks``, ``jobs``, ``redis``, ``celery``, ``share``)."""

    def __init__(self, rt, *, stall_s: float):
        self.rt = rt
        self.stall_s = stall_s
        self.suspects = Suspects(rt.redis, SUSPECTS_KEY, ttl=int(stall_s + 600))

    def sweep(self) -> tuple[list[str], list[str]]:
        """One sweep; the jobs whose ``job_ended`` and the events whose next attempt were sent again."""
        store = self.rt.webhooks
        before = time.time() - self.stall_s
        owed = store.owed(before=before, limit=MAX_CANDIDATES)
        overdue = store.overdue(before=before, limit=MAX_CANDIDATES)
        if not owed and not overdue:
            self.suspects.clear()
            return [], []
        events = {event_id: store.get(event_id) for event_id in overdue}
        store.forget_open([event_id for event_id, event in events.items()
                           if event is None or event["state"] in FINAL_STATES])
        events = {event_id: event for event_id, event in events.items()
                  if event is not None and event["state"] not in FINAL_STATES}
        jobs = dict(zip(owed, self.rt.jobs.get_many(owed), strict=True))
        for job_id in [job_id for job_id, job in jobs.items() if job is None]:
            store.settle(job_id)  # expired: nothing left to report
        owed = [job_id for job_id, job in jobs.items() if job is not None]
        carried = ids_in_messages(self.rt.redis, _IDS, queues=(WEBHOOKS_QUEUE,),
                                  parked=self.rt.share("webhooks").entries())
        # An event's first attempt runs inside its job's job_ended task: that message carries it too.
        missing = [job_id for job_id in owed if job_id not in carried] + [
            event_id for event_id, event in events.items()
            if event_id not in carried and event["object_id"] not in carried]
        lost = set(self.suspects.confirm(missing))
        suspected = set(missing) - lost
        lost_jobs = [job_id for job_id in owed if job_id in lost]
        lost_events = [event_id for event_id in events if event_id in lost]
        for job_id in lost_jobs:
            self.rt.celery.send_task(JOB_ENDED_TASK, args=[job_id], queue=WEBHOOKS_QUEUE)
        for event_id in lost_events:
            attempt = events[event_id]["attempts"] + 1
            store.release_claim(event_id, attempt)
            queue_attempt(self.rt.celery, event_id, attempt, countdown=0)
        # The new suspects keep their place: the next sweep must look at them again.
        store.postpone(owed=[job_id for job_id in owed if job_id not in suspected],
                       events=[event_id for event_id in events if event_id not in suspected])
        if lost_jobs or lost_events:
            log.warning("webhooks no message carried were sent again: jobs %s, events %s",
                        ", ".join(lost_jobs) or "-", ", ".join(lost_events) or "-")
        return lost_jobs, lost_events


def start_webhook_reaper(rt, *, stall_s: float) -> threading.Event:
    """Sweep in a daemon thread, at most once per interval across all workers, until the event is set."""
    reaper = WebhookReaper(rt, stall_s=stall_s)
    return start_sweeping(rt.redis, "webhooks", reaper.sweep, every_s=sweep_every(stall_s))
