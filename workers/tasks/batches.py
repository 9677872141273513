"""The batch tasks (queue ``batches``).

- ``rollout.batches.enqueue_chunk(batch_id, index)``: creates the jobs of one chunk of a batch's
  valid lines in one round trip and sends each job's first task (the GPU queue for plain token
  prompts, preprocessing for the rest), so batch lines share the CPU workers, the multimodal
  cache and GPU batching with every other job (plain score lines skip jobs altogether:
  ``workers/tasks/score_lines.py``). The API sends one message per chunk of
  ``settings.batch_chunk_size`` lines, never one per line; a chunk with score lines as soon as it
  is stored, while the file is still read (the batch ``validating``), when only its direct score
  lines run, and again at the end for the rest.
- ``rollout.batches.cancel(batch_id)``: the slow half of ``POST /v1/batches/{id}/cancel``.
- ``rollout.batches.expire(batch_id)``: ends the batch when its completion window is over.

Backpressure: batch jobs count toward the owner's and the service's caps on unfinished jobs, like
any other job. When a cap is reached (``QueueFullError``) the chunk task retries itself after the
``Retry-After`` the store gave and continues where it stopped; lines never fail for backpressure,
they wait (at worst until the batch expires).

Idempotency (messages are acked late, may be redelivered, and go back to the queue when Redis goes
away under a task: workers/tasks/outage.py): a chunk task skips lines that already have a job or
are already counted. A task killed between creating a chunk's jobs and recording them makes
those lines run twice; the batch counts whichever run of a line ends first.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from domain.batches.messages import schedule_expiry, send_score_lines
from domain.batches.progress import CANCELLED, EXPIRED, job_entry, line_error, record_lines
from domain.batches.store import DIRECT_LINE
from domain.batches.sweeps import cancel_lines, expire
from domain.infra import finite_json
from domain.infra.redis_client import REDIS_DOWN
from domain.infra.redis_memory import read_memory
from domain.infra.redis_reservations import Reservations
from domain.infra.store_errors import StoreFull
from domain.jobs.request import JobRequest
from domain.jobs.store import TERMINAL as JOB_TERMINAL
from domain.jobs.store import QueueFullError
from domain.jobs.submission import new_job_ids, result_reservations, submit_jobs
from domain.lifecycle import cancel_job
from domain.names import (
    CANCEL_BATCH_TASK,
    ENQUEUE_CHUNK_TASK,
    EXPIRE_BATCH_TASK,
)
from engine.errors import NotFoundError
from workers.runtime import runtime
from workers.tasks.outage import requeued_while_redis_is_down
from workers.tasks.score_lines import scorable_directly

log = logging.getLogger(__name__)

DEFAULT_RETRY_AFTER = 5.0


# --- Tasks ----------------------------------------------------------------------------------------

@shared_task(name=ENQUEUE_CHUNK_TASK, bind=True, max_retries=None)
def enqueue_chunk(self, batch_id: str, index: int) -> int:
    rt = runtime(self.app)
    with requeued_while_redis_is_down(f"chunk {index} of batch {batch_id}"):
        try:
            return submit_chunk(rt, batch_id, index)
        except QueueFullError as full:
            raise self.retry(countdown=_retry_after(full), max_retries=None) from None
        except StoreFull as full:  # its results do not fit below Redis' mark yet: later
            raise self.retry(countdown=float(full.headers["Retry-After"]), max_retries=None) from None


@shared_task(name=CANCEL_BATCH_TASK, bind=True)
def cancel(self, batch_id: str) -> None:
    with requeued_while_redis_is_down(f"cancelling batch {batch_id}"):
        cancel_lines(runtime(self.app), batch_id)


@shared_task(name=EXPIRE_BATCH_TASK, bind=True)
def expire_check(self, batch_id: str) -> None:
    rt = runtime(self.app)
    with requeued_while_redis_is_down(f"the expiry check of batch {batch_id}"):
        remaining = expire(rt, batch_id)
        if remaining is not None:
            schedule_expiry(self.app, rt.settings, batch_id, remaining)


# --- The work (plain functions of the runtime: tests call them directly) --------------------------

def submit_chunk(rt, batch_id: str, index: int) -> int:
    """Create and enqueue the jobs of chunk ``index``; how many were created.

    Raises ``QueueFullError`` when a cap on unfinished jobs is reached (the lines created so far
    stay; the retry carries on after them).
    """
    store = rt.batches
    try:
        batch = store.get(batch_id)
    except NotFoundError:
        return 0
    if batch["status"] not in ("validating", "in_progress"):
        return 0  # cancelled or expired: the cancel / expiry sweep counts these lines
    lines = store.chunk(batch_id, index, batch["chunk_size"])
    numbers = [line["line"] for line in lines]
    ended = store.ended(batch_id, numbers)
    given = _jobs_held(rt, batch_id, store.line_jobs(batch_id, [n for n in numbers if n not in ended]))
    skip = ended | set(given)
    direct = [line for line in lines
              if line["line"] not in skip and scorable_directly(line["request"], rt.model_facts)]
    if direct:
        direct_lines = dict.fromkeys((line["line"] for line in direct), DIRECT_LINE)
        given |= direct_lines
        store.set_line_jobs(batch_id, direct_lines, expire_at=batch["keys_expire_at"])
        store.owe_scoring(batch_id, index, expire_at=batch["keys_expire_at"])  # the reaper's mark
        send_score_lines(rt.celery, batch_id, index)
        skip |= {line["line"] for line in direct}
    if batch["status"] == "validating":
        # Its file is still read: only its direct score lines run now, which nothing outside the
        # batch sees if the upload is refused (domain.batches.creation); the rest when it closes.
        if all(line["line"] in skip for line in lines):
            _mark_submitted(rt, batch, index, {n: given.get(n) for n in numbers})
        return 0
    readable, unreadable = [], []
    for line in lines:
        if line["line"] not in skip:
            try:
                readable.append((line, JobRequest.from_dict(line["request"])))
            except Exception:  # a bug or a corrupted record, not a user error (the lines were validated)
                log.exception("batch %s chunk %d: could not create jobs: line %s is no request", batch_id, index,
                              line.get("line"))
                unreadable.append(line)
    _cannot_run(rt, batch_id, unreadable)
    created: dict[int, str] = {}
    job_ids = _reserve(rt, [request for _, request in readable])  # StoreFull: the chunk waits
    try:
        # One round trip creates the chunk's jobs, one more maps their lines.
        outcomes = submit_jobs(rt.jobs, rt.celery, owner=batch["owner"], model=rt.model_facts, job_ids=job_ids,
                               requests=[(request, _job_extra(batch_id, line)) for line, request in readable])
        created = {line["line"]: job["id"] for (line, _), job in zip(readable, outcomes, strict=True)
                   if not isinstance(job, QueueFullError)}
        if created:
            store.set_line_jobs(batch_id, created, expire_at=batch["keys_expire_at"])
        if full := next((job for job in outcomes if isinstance(job, QueueFullError)), None):
            raise full  # the retry carries on after the lines created
    except (QueueFullError, *REDIS_DOWN):
        raise
    except Exception:
        log.exception("batch %s chunk %d: could not create jobs", batch_id, index)
        _cannot_run(rt, batch_id, [line for line, _ in readable if line["line"] not in created])
    finally:
        _release(rt, sorted(set(job_ids) - set(created.values())))  # the jobs not made
        if created:
            _cancel_if_stopped(rt, batch, list(created.values()))
    _mark_submitted(rt, batch, index, {n: given.get(n) or created.get(n) for n in numbers})
    return len(created)


def _reserve(rt, requests: list[JobRequest]) -> list[str]:
    """Ids for the chunk's jobs, each one's result bound reserved under it against Redis' headroom
    (domain/infra/redis_reservations.py; none on a Redis without a bound): all of them or, with
    :class:`StoreFull`, none."""
    job_ids = new_job_ids(len(requests))
    if requests and read_memory(rt.redis).bounded:
        Reservations(rt.redis).reserve(result_reservations(job_ids, requests, limits=rt.limits,
                                                           vocab_size=rt.model_facts.vocab_size,
                                                           routed_bytes_per_token=rt.model_facts.routed_bytes_per_token))
    return job_ids


def _release(rt, job_ids: list[str]) -> None:
    try:
        Reservations(rt.redis).release(job_ids)
    except REDIS_DOWN:  # they lapse (redis_reservations.LIFETIME_SECONDS)
        log.warning("could not release the reservations of %d jobs not made", len(job_ids))


def _jobs_held(rt, batch_id: str, mapped: dict[int, str]) -> dict[int, str]:
    """Of the lines ``mapped`` to a job, those whose job is here. In a split brain a chunk's jobs can
    be written to an old primary and lost while their mapping reaches the new one: such a line gets
    a new job (a direct line's lost run is its scoring debt's, ``BatchStore.scoring_done``)."""
    made = [job_id for job_id in mapped.values() if job_id != DIRECT_LINE]
    here = rt.jobs.existing(made)
    lost = {line: job_id for line, job_id in mapped.items() if job_id != DIRECT_LINE and job_id not in here}
    if lost:
        log.warning("batch %s: the jobs of lines %s are not on the primary; made again", batch_id, sorted(lost))
    return {line: job_id for line, job_id in mapped.items() if line not in lost}


def _mark_submitted(rt, batch: dict[str, Any], index: int, lines: dict[int, str | None]) -> None:
    if not rt.batches.chunks_submitted(batch["id"], index, lines, expire_at=batch["keys_expire_at"]):
        log.warning("batch %s chunk %d: not all of its lines' jobs are on the primary; the batch reaper "
                    "sends it again", batch["id"], index)


def _cannot_run(rt, batch_id: str, lines: list[dict[str, Any]]) -> None:
    """Lines the service cannot run (a bug, not a user error): each gets its error, and the batch
    goes on and ends ``failed``."""
    if lines:
        rt.batches.mark_broken(batch_id)
        record_lines(rt, batch_id, [line_error(line, "internal_error", "the service could not run this line")
                                    for line in lines])


def _job_extra(batch_id: str, line: dict[str, Any]) -> dict[str, str]:
    extra = {"batch_id": batch_id, "custom_id": line["custom_id"], "line": str(line["line"])}
    if line.get("reply"):  # how the API renders this line's result (OpenAI-format lines)
        extra["reply"] = finite_json.compact(line["reply"])
    return extra


def _cancel_if_stopped(rt, batch: dict, job_ids: list[str]) -> None:
    """A cancel or the expiry may have swept the batch while this chunk made jobs: cancel those."""
    status = rt.batches.get(batch["id"])["status"]
    if status == "in_progress":
        return
    reason = EXPIRED if status == "expired" else CANCELLED
    entries = []
    for job_id in job_ids:
        job = cancel_job(rt, job_id, owner=batch["owner"])
        if job["status"] in JOB_TERMINAL:
            entries.append(job_entry(job, reason))
    record_lines(rt, batch["id"], entries)


def _retry_after(error: QueueFullError) -> float:
    try:
        return float(error.headers.get("Retry-After", DEFAULT_RETRY_AFTER))
    except ValueError:
        return DEFAULT_RETRY_AFTER
