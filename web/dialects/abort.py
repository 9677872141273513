"""Aborting the caller's own unfinished jobs (SGLang's ``/abort_request``, vLLM's ``/abort_requests``).

An aborted job ends as a cancel does (``domain.lifecycle.cancel_job``): one not yet generating
ends ``cancelled`` at once; a generating one stops at its next decode step and keeps its tokens so
far, ``finish_reason: abort``. A synchronous call waiting on the job answers with that.
"""

from __future__ import annotations

from collections.abc import Collection

from domain.jobs.store import TERMINAL
from domain.lifecycle import cancel_job
from web.services import services

_PAGE = 200


def abort_jobs(owner: str, *, request_ids: Collection[str] | None = None) -> int:
    """Cancel the owner's unfinished jobs (only those with one of ``request_ids`` when given); how many."""
    svc = services()
    # The owner's active-job counter says how many unfinished jobs exist, so the newest-first walk
    # over the owner's index stops once it has seen them all (unfinished jobs are the recent ones).
    remaining = svc.jobs.active_count(owner)
    cancelled, cursor = 0, None
    while remaining > 0:
        jobs, cursor = svc.jobs.list(owner=owner, status=None, limit=_PAGE, cursor=cursor)
        for job in jobs:
            if job["status"] in TERMINAL:
                continue
            remaining -= 1
            if request_ids is None or job.get("request_id") in request_ids:
                cancel_job(svc, job["id"], owner=owner)
                cancelled += 1
        if cursor is None:
            break
    return cancelled
