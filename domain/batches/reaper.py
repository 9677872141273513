"""A batch's own work that no message carries any more, found and sent again (how:
``domain/infra/lost_messages.py``).

A batch's lines become jobs through its chunk messages (``enqueue_chunk``), its directly scored
lines through ``score_lines`` messages, and it ends on time through a self-rearming expiry check.
The crashes that lose a job's message (``domain/jobs/reaper.py``) lose these too, and then a
chunk's lines never run, or a batch past its window never ends.

The batch store indexes every batch not ended (``BatchStore.open_batches``). Each sweep looks at
the batches it has not looked at for ``stall_s`` seconds (``ROLLOUT_STALLED_JOB_AFTER``):

- one ``in_progress``: a chunk not yet submitted, or owed a scoring run, that no message in the
  batches queue, the shared generate queue or kombu's unacknowledged messages carries, in two
  sweeps running, gets its message again;
- one past its completion window: the expiry check is sent again. No search first: a check that
  finds the batch ended does nothing, so a duplicate costs one no-op per stall period;
- one whose lines are all counted (``settled``) but which has not ended: the worker that counted
  its last line died before ending it. It is ended here (``finish`` is idempotent);
- one still ``validating`` whose intake has not written for ``stall_s``: the API reading its file
  died, and no one was told of the batch. It is discarded (``domain.batches.creation``).

And a job of a batch that ended ``stall_s`` ago with its line still not counted (the worker that
ended it died, or a failover took the count but kept the end: ``JobStore.uncounted_lines``) has its
line counted here; and a batch that ended ``stall_s`` ago still owed its webhook event (the worker
that ended it died before making it: ``WebhookStore.owed_batches``, recorded by the move that
ended it) gets it. Counting and making an event are idempotent, so no search first.
"""

from __future__ import annotations

import logging
import threading
import time

from domain.batches.messages import send_chunk, send_score_lines
from domain.batches.progress import finish, record_job_lines
from domain.batches.statuses import TERMINAL
from domain.batches.store import public_batch
from domain.infra.lost_messages import Suspects, start_sweeping, sweep_every, task_calls_in_messages
from domain.names import (
    BATCHES_QUEUE,
    ENQUEUE_CHUNK_TASK,
    EXPIRE_BATCH_TASK,
    SCORE_LINES_TASK,
    SHARED_GENERATE_QUEUE,
)
from domain.webhooks.emit import emit_batch_event

log = logging.getLogger(__name__)

SUSPECTS_KEY = "rq:batches:suspects"  # "<task> <batch id> <chunk>" the last sweep found no message for
MAX_CANDIDATES = 200  # batches per sweep; the oldest looked-at first


class BatchReaper:
    """``rt``: a worker's runtime (``batches``, ``redis``, ``celery``)."""

    def __init__(self, rt, *, stall_s: float):
        self.rt = rt
        self.stall_s = stall_s
        self.suspects = Suspects(rt.redis, SUSPECTS_KEY, ttl=int(stall_s + 600))

    def sweep(self) -> list[tuple[str, str, int]]:
        """One sweep; the (task, batch id, chunk) sent again (chunk -1 for an expiry check)."""
        store, now = self.rt.batches, time.time()
        self.count_lost_lines(before=now - self.stall_s)
        self.emit_owed_events(before=now - self.stall_s)
        candidates = store.open_batches(before=now - self.stall_s, limit=MAX_CANDIDATES)
        if not candidates:
            self.suspects.clear()
            return []
        batches = dict(zip(candidates, store.get_many(candidates), strict=True))
        store.forget_open([batch_id for batch_id, batch in batches.items()
                           if batch is None or batch["status"] in TERMINAL])
        live = {batch_id: batch for batch_id, batch in batches.items()
                if batch is not None and batch["status"] not in TERMINAL}
        if abandoned := [batch for batch in live.values()
                         if batch["status"] == "validating" and batch.get("intake_at", batch["created_at"]) < now - self.stall_s]:
            log.warning("batches whose upload stopped while its file was read were discarded: %s",
                        ", ".join(batch["id"] for batch in abandoned))
            for batch in abandoned:
                store.discard(batch)
                live.pop(batch["id"])
        sent: list[tuple[str, str, int]] = []
        if unended := [batch_id for batch_id, batch in live.items() if batch.get("settled")]:
            log.warning("batches whose lines were all counted but which had not ended were ended: %s",
                        ", ".join(unended))
            for batch_id in unended:
                finish(self.rt, batch_id)
                live.pop(batch_id)
        for batch_id, batch in live.items():
            if batch["expires_at"] <= now:
                self.rt.celery.send_task(EXPIRE_BATCH_TASK, args=[batch_id], queue=BATCHES_QUEUE)
                sent.append((EXPIRE_BATCH_TASK, batch_id, -1))
        owed = {batch_id: self._owed(batch) for batch_id, batch in live.items()
                if batch["status"] == "in_progress" and batch["expires_at"] > now}
        missing: list[str] = []
        if any(owed.values()):
            carried = task_calls_in_messages(self.rt.redis, (ENQUEUE_CHUNK_TASK, SCORE_LINES_TASK),
                                             queues=(BATCHES_QUEUE, SHARED_GENERATE_QUEUE))
            missing = [_suspect(*call) for calls in owed.values() for call in calls if call not in carried]
        lost = self.suspects.confirm(missing)
        for task, batch_id, index in map(_call, lost):
            (send_chunk if task == ENQUEUE_CHUNK_TASK else send_score_lines)(self.rt.celery, batch_id, index)
            sent.append((task, batch_id, index))
        # A batch with a suspect keeps its place: the next sweep must look at it again.
        suspected = {_call(item)[1] for item in missing} - {batch_id for _, batch_id, _ in map(_call, lost)}
        store.looked_at([batch_id for batch_id in live if batch_id not in suspected])
        if lost:
            log.warning("batch work no message carried was sent again: %s", ", ".join(lost))
        return sent

    def count_lost_lines(self, *, before: float) -> list[str]:
        """Count the lines of jobs that ended before ``before`` and are still uncounted; their ids."""
        job_ids = self.rt.jobs.uncounted_lines(before=before, limit=MAX_CANDIDATES)
        if not job_ids:
            return []
        jobs = dict(zip(job_ids, self.rt.jobs.get_many(job_ids), strict=True))
        self.rt.jobs.lines_counted([job_id for job_id, job in jobs.items() if job is None])  # expired
        ended = [job for job in jobs.values() if job is not None]
        record_job_lines(self.rt, ended)
        log.warning("batch lines of ended jobs still uncounted were counted: %s",
                    ", ".join(job["id"] for job in ended))
        return [job["id"] for job in ended]

    def emit_owed_events(self, *, before: float) -> list[str]:
        """Make the webhook events of the batches that ended before ``before`` and are still owed
        one; their ids."""
        batch_ids = self.rt.webhooks.owed_batches(before=before, limit=MAX_CANDIDATES)
        emitted = []
        for batch_id, batch in zip(batch_ids, self.rt.batches.get_many(batch_ids), strict=True):
            if batch is None or batch["status"] not in TERMINAL:
                self.rt.webhooks.settle_batch(batch_id)  # expired: nothing left to report
                continue
            emit_batch_event(self.rt, public_batch(batch), f"batch.{batch['status']}")
            emitted.append(batch_id)
        if emitted:
            log.warning("batches whose end made no webhook event got it: %s", ", ".join(emitted))
        return emitted

    def _owed(self, batch: dict) -> list[tuple[str, str, int]]:
        submitted, scoring = self.rt.batches.chunk_progress(batch["id"])
        calls = [(ENQUEUE_CHUNK_TASK, batch["id"], index) for index in range(batch["chunks"]) if index not in submitted]
        return calls + [(SCORE_LINES_TASK, batch["id"], index) for index in sorted(scoring)]


def _suspect(task: str, batch_id: str, index: int) -> str:
    return f"{task} {batch_id} {index}"


def _call(suspect: str) -> tuple[str, str, int]:
    task, batch_id, index = suspect.split(" ")
    return task, batch_id, int(index)


def start_batch_reaper(rt, *, stall_s: float) -> threading.Event:
    """Sweep in a daemon thread, at most once per interval across all workers, until the event is set."""
    reaper = BatchReaper(rt, stall_s=stall_s)
    return start_sweeping(rt.redis, "batches", reaper.sweep, every_s=sweep_every(stall_s))
