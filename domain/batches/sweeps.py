"""Stopping a batch early: cancel its jobs and count the lines they leave.

- the batch is cancelled: :func:`cancel_lines` cancels the jobs not started yet and counts the
  lines that never got a job as ``batch_cancelled`` errors; jobs already generating are asked to
  abort and end by themselves;
- the batch expires: :func:`expire` counts every line not done as a ``batch_expired`` error.
"""

from __future__ import annotations

import time
from typing import Any

from domain.batches.progress import (
    CANCELLED,
    EXPIRED,
    emit,
    finish,
    job_entry,
    line_error,
    publish_results,
    record_lines,
)
from domain.batches.statuses import TERMINAL as BATCH_TERMINAL
from domain.batches.store import DIRECT_LINE
from domain.jobs.store import TERMINAL as JOB_TERMINAL
from domain.lifecycle import cancel_job
from engine.errors import NotFoundError


def cancel_lines(rt, batch_id: str) -> None:
    """For a ``cancelling`` batch: cancel its jobs not yet generating, count the lines without jobs."""
    try:
        batch = rt.batches.get(batch_id)
    except NotFoundError:
        return
    if batch["status"] == "cancelling":
        _sweep(rt, batch, CANCELLED, wait_for_running=True)


def expire(rt, batch_id: str) -> float | None:
    """Expire the batch if its window has ended; else the seconds until it ends (None: nothing to do)."""
    store = rt.batches
    try:
        batch = store.get(batch_id)
    except NotFoundError:
        return None
    if batch["status"] in BATCH_TERMINAL:
        return None
    remaining = batch["expires_at"] - time.time()
    if remaining > 0:
        return remaining
    if batch["status"] == "finalizing":  # its finisher died between the two moves
        finish(rt, batch_id)
        return None
    if not store.move(batch_id, "expired", from_=("validating", "in_progress", "cancelling")):
        return None
    _sweep(rt, batch, EXPIRED, wait_for_running=False)
    store.release(batch_id)
    publish_results(rt, batch_id)
    emit(rt, batch_id, "batch.expired")
    return None


def _sweep(rt, batch: dict[str, Any], reason: tuple[str, str], *, wait_for_running: bool) -> None:
    """Count every line not yet counted: cancel its job; a line whose job still runs is left to end
    by itself when ``wait_for_running`` (its job was asked to abort), else counted as ``reason``."""
    store = rt.batches
    batch_id, owner = batch["id"], batch["owner"]
    code, message = reason
    for page in store.iter_lines(batch_id):
        done = store.ended(batch_id, [line["line"] for line in page])
        pending = [line for line in page if line["line"] not in done]
        # Lines scored directly (no job) are counted below like lines without a job.
        job_ids = {line: job_id for line, job_id in store.line_jobs(batch_id, [line["line"] for line in pending]).items()
                   if job_id != DIRECT_LINE}
        jobs = dict(zip(job_ids.values(), rt.jobs.get_many(list(job_ids.values())), strict=True))
        entries = []
        for line in pending:
            job_id = job_ids.get(line["line"])
            job = jobs.get(job_id) if job_id else None
            if job is not None and job["status"] not in JOB_TERMINAL:
                job = cancel_job(rt, job_id, owner=owner)
            if job is not None and job["status"] in JOB_TERMINAL:
                entries.append(job_entry(job, reason))
            elif job is None or not wait_for_running:
                entries.append(line_error(line, code, message, job_id))
        record_lines(rt, batch_id, entries)
