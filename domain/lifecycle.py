"""Ending a job: the one place that moves a job to a terminal state and fires what follows.

``rt`` is anything with ``jobs``, ``redis``, ``settings`` and ``celery``: a worker's runtime or
the API's services. Only the call that actually moves the job (the job store's compare-and-set) fires the follow-ups,
so a task that runs twice (a redelivered message) sends one webhook and counts one batch line.
"""

from __future__ import annotations

import logging
from typing import Any

from domain.batches.progress import record_job_lines
from domain.infra.metrics import MetricsBatch, record_job_ends
from domain.jobs.attempts import Fence
from domain.jobs.store import TERMINAL
from domain.names import JOB_ENDED_TASK, WEBHOOKS_QUEUE
from engine.errors import InternalError, RolloutError

log = logging.getLogger(__name__)


def end_job(rt, job_id: str, status: str, *, job: dict[str, Any] | None = None, **fields: Any) -> bool:
    """End the job with ``status`` and ``fields``. ``job``, the record as the caller last read it,
    saves reading it back."""
    moved = rt.jobs.advance(job_id, status, owner=job["owner"] if job else None, **fields)
    if moved:
        _after_end(rt, job_id, {**job, "status": status, **fields} if job else None)
    return moved


def end_jobs(rt, endings: list[tuple[dict[str, Any], str, dict[str, Any]]], *,
             metrics: MetricsBatch | None = None) -> list[bool]:
    """``end_job`` for many ``(job record, status, fields)`` at once (a GPU batch's results): the
    moves and the metrics take one round trip each, not one per job. ``metrics``: count the ends
    there, for its owner to write later, not now."""
    return [outcome == 1 for outcome in end_fenced(rt, endings, [None] * len(endings), metrics=metrics)]


def end_fenced(rt, endings: list[tuple[dict[str, Any], str, dict[str, Any]]], fences: list[Fence | None], *,
               metrics: MetricsBatch | None = None) -> list[int]:
    """``end_jobs``, each end made only by the newest run of its job (``fences``, see
    domain/jobs/attempts.py): per job the move's outcome (``JobStore.advance_fenced``). A late
    run's end writes nothing and fires nothing."""
    outcomes = rt.jobs.advance_fenced([(job["id"], job["owner"], status, fields) for job, status, fields in endings],
                                      fences)
    _after_ends(rt, [{**job, "status": status, **fields}
                     for (job, status, fields), outcome in zip(endings, outcomes, strict=True) if outcome == 1],
                metrics=metrics)
    return outcomes


def fail_job(rt, job_id: str, error: RolloutError, *, fence: Fence | None = None) -> bool:
    """``fence``: fail only while that run is the newest (a late run's error is no job's end)."""
    moved = rt.jobs.fail(job_id, error, fence=fence)
    if moved:
        log.info("job %s failed: %s", job_id, error.code)
        _after_end(rt, job_id)
    return moved


def fail_unexpected(rt, job_id: str, stage: str, *, fence: Fence | None = None) -> bool:
    """Fail a job on an unexpected exception (logged with its traceback, never shown to users)."""
    log.exception("job %s: unexpected error while %s", job_id, stage)
    return fail_job(rt, job_id, InternalError(f"internal error while {stage}"), fence=fence)


def cancel_job(rt, job_id: str, *, owner: str) -> dict[str, Any]:
    """Cancel: a job not yet generating ends now; a generating one is asked to abort. Idempotent."""
    job = rt.jobs.get(job_id, owner=owner)
    if job["status"] in TERMINAL:
        return job
    if job["status"] == "generating" or not end_job(rt, job_id, "cancelled"):
        # Generating (or it got there meanwhile): the GPU worker stops at its next step.
        rt.jobs.request_abort(job_id)
    return rt.jobs.get(job_id, owner=owner)


def resume_followups(rt, jobs: list[dict[str, Any]]) -> None:
    """Redo what ending these already-ended jobs starts (their batch line, their webhook), for a
    task that finds its job ended when its message comes back.

    Ending a job and queueing its follow-ups are separate Redis calls; when Redis goes away between
    them, the task fails and its message comes back (requeued, or restored after the visibility
    timeout), and lands here. Both follow-ups are idempotent: a batch line counts once and a job's
    webhook event is made once, so a message that comes back for another reason costs a no-op.
    """
    _after_ends(rt, [job for job in jobs if job["status"] in TERMINAL], count=False)


def _after_end(rt, job_id: str, job: dict[str, Any] | None = None) -> None:
    _after_ends(rt, [job or rt.jobs.get(job_id)])


def _after_ends(rt, jobs: list[dict[str, Any]], *, count: bool = True, metrics: MetricsBatch | None = None) -> None:
    if not jobs:
        return
    if metrics is not None:
        metrics.job_ends(jobs)
    elif count:
        record_job_ends(rt.redis, jobs)
    record_job_lines(rt, [job for job in jobs if job.get("batch_id")])
    hooked = [job["id"] for job in jobs if job.get("webhook") or rt.settings.key_webhooks.get(job.get("owner", ""))]
    # The move that ended each job recorded its webhook debt (domain/jobs/store.py): a job_ended
    # message lost on its way, or with a failed-over primary, is sent again (domain/webhooks/reaper.py).
    for job_id in hooked:
        rt.celery.send_task(JOB_ENDED_TASK, args=[job_id], queue=WEBHOOKS_QUEUE)
