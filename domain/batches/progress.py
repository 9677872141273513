"""A batch's progress: count its lines as they end, and end the batch when the last one does.

Lines end in three ways, and each is counted once (``BatchStore.record`` skips a line seen before):

- its job ends: ``domain.lifecycle`` calls :func:`record_job_lines` for the calls that ended them;
- the batch is cancelled or expires: ``domain.batches.sweeps`` cancels its jobs and counts the
  lines left (it ends jobs, so it sits above ``domain.lifecycle``, which sits above this module).

Whoever counts the last line calls :func:`finish`, which moves the batch to its end status once
(compare-and-set), drops its inputs and sends the batch webhook.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from domain.batches.store import public_batch
from domain.error_statuses import http_status
from domain.infra.redis_records import new_id
from domain.webhooks.emit import emit_batch_event
from engine.errors import NotFoundError, RolloutError

log = logging.getLogger(__name__)

JOB_CANCELLED = ("cancelled", "the job was cancelled")
CANCELLED = ("batch_cancelled", "the batch was cancelled before this line ran")
EXPIRED = ("batch_expired", "the batch's completion window ended before this line finished")


def record_job_lines(rt, jobs: list[dict[str, Any]]) -> None:
    """Count the ended jobs' lines (jobs of any batches): results go to a batch's output, errors to
    its errors; one ``record`` per batch, not per job.

    Called by ``domain.lifecycle`` for the calls that ended the jobs, and by the batch reaper for
    ended jobs whose count a crash lost (``JobStore.uncounted_lines``); a line counted before is a
    no-op.
    """
    by_batch: dict[str, list[dict[str, Any]]] = {}
    for job in jobs:
        if job.get("line"):
            by_batch.setdefault(job["batch_id"], []).append(job)
        else:
            log.error("job %s names batch %s but no line; not counted", job["id"], job["batch_id"])
    for batch_id, ended in by_batch.items():
        cancelled_as = JOB_CANCELLED
        if any(job["status"] == "cancelled" for job in ended):
            # Cancelled with its batch, or on its own: the line's error says which.
            try:
                status = rt.batches.get(batch_id)["status"]
            except NotFoundError:
                continue
            cancelled_as = {"cancelling": CANCELLED, "cancelled": CANCELLED, "expired": EXPIRED}.get(
                status, JOB_CANCELLED)
        record_lines(rt, batch_id, [job_entry(job, cancelled_as) for job in ended])
    rt.jobs.lines_counted([job["id"] for job in jobs if not job.get("line")])  # never to be counted
    counted = [(job["id"], job["batch_id"], int(job["line"])) for job in jobs if job.get("line")]
    if (dropped := rt.batches.settle_line_debts(counted)) < len(counted):
        log.warning("%d of the lines of jobs %s are not counted on the primary (a failover took them); the "
                    "batch reaper counts them again", len(counted) - dropped, ", ".join(job_id for job_id, *_ in counted))


def record_lines(rt, batch_id: str, entries: list[tuple[int, bool, dict[str, Any]]]) -> None:
    """Count lines as ended (see ``BatchStore.record``); ends the batch when they were the last."""
    if rt.batches.record(batch_id, entries):
        finish(rt, batch_id)


def job_entry(job: dict[str, Any], cancelled_as: tuple[str, str] = JOB_CANCELLED) -> tuple[int, bool, dict[str, Any]]:
    """(line, succeeded, the line's output or error entry) for an ended job."""
    line = int(job["line"])
    entry: dict[str, Any] = {"custom_id": job.get("custom_id"), "line": line, "job_id": job["id"]}
    if job.get("reply"):
        entry["reply"] = json.loads(job["reply"])
    if job["status"] == "succeeded":
        entry["response"] = {"status_code": 200, "body": job.get("result")}
        return line, True, entry
    if job["status"] == "cancelled":
        code, message = cancelled_as
        entry["error"] = {"code": code, "message": message}
    else:
        error = RolloutError.from_record(job.get("error") or {})
        entry["error"] = {"code": error.code, "message": error.message}
        # The status the request would have been answered with: OpenAI's results tell a request
        # that got an error response from one that never ran.
        entry["status_code"] = http_status(error)
    return line, False, entry


def line_error(line: dict[str, Any], code: str, message: str, job_id: str | None = None) -> tuple[int, bool, dict]:
    entry: dict[str, Any] = {"custom_id": line.get("custom_id"), "line": line["line"]}
    if job_id:
        entry["job_id"] = job_id
    entry["error"] = {"code": code, "message": message}
    return line["line"], False, entry


def finish(rt, batch_id: str) -> None:
    """End a batch whose lines are all counted. Safe to call more than once; one call moves it."""
    store = rt.batches
    for _ in range(3):  # the status may change under us (a cancel racing the last line): re-read
        batch = store.get(batch_id)
        status = batch["status"]
        if status in ("validating", "in_progress", "finalizing"):
            if status != "finalizing" and not store.move(batch_id, "finalizing", from_=(status,)):
                continue
            store.release(batch_id)
            publish_results(rt, batch_id)
            final = "failed" if batch.get("broken") else "completed"
            if store.move(batch_id, final, from_=("finalizing",)):
                emit(rt, batch_id, f"batch.{final}")
            return
        if status == "cancelling":
            publish_results(rt, batch_id)  # all lines are counted: the results are final
            if not store.move(batch_id, "cancelled", from_=("cancelling",)):
                continue
            store.release(batch_id)
            emit(rt, batch_id, "batch.cancelled")
            return
        store.release(batch_id)  # already ended (expired): only the clean-up is left
        publish_results(rt, batch_id)
        return


# Batch fields naming its results files (OpenAI's names).
RESULTS_FILES = (("output", "output_file_id"), ("errors", "error_file_id"))


def publish_results(rt, batch_id: str) -> None:
    """Make the ended batch's results files for ``/v1/files`` (once; only for results it has).

    They hold no copy of the results: the API renders them from the batch's lists on download.
    """
    store = rt.batches
    batch = store.get(batch_id)
    for which, field in RESULTS_FILES:
        if batch.get(field) or not store.results_count(batch_id, which):
            continue
        file_id = new_id("file")
        if store.claim(batch_id, field, file_id):
            rt.files.add_results(batch, which, file_id=file_id, expires_at=batch["keys_expire_at"])


def emit(rt, batch_id: str, event: str) -> None:
    """Send the batch webhook (``emit_batch_event`` decides whether the batch or its owner wants one)."""
    batch = rt.batches.get(batch_id)
    try:
        emit_batch_event(rt, public_batch(batch), event)
    except Exception:
        # The batch has ended either way; a webhook fault must not fail the job end that got here.
        log.exception("batch %s: could not emit %s", batch_id, event)
