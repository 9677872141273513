"""The Redis keys of job records, built in one place: the job store and its scripts' callers use
these (a job's event stream and attempt counters are named beside their scripts, in
``domain.jobs.events`` and ``domain.jobs.attempts``)."""

from __future__ import annotations

TOTAL_ACTIVE_KEY = "rq:active:_total"  # unfinished jobs of every owner (the total queue cap)
UNFINISHED_KEY = "rq:unfinished"  # every unfinished job, scored by its last move (the reaper's index)
WEBHOOK_OWED_KEY = "rq:webhook:owed"  # ended jobs whose webhook event is not made yet (the webhook store's)
UNCOUNTED_LINES_KEY = "rq:batch:uncounted"  # ended jobs of batches whose line is not counted yet


def job_key(job_id: str) -> str:
    return f"rq:job:{job_id}"


def prompt_key(job_id: str) -> str:
    """Where the finalized prompt waits for the GPU worker (``JobStore.save_prompt``)."""
    return f"rq:job:{job_id}:prompt"


def cancel_key(job_id: str) -> str:
    return f"rq:job:{job_id}:cancel"


def done_key(job_id: str) -> str:
    return f"rq:job:{job_id}:done"


def active_key(owner: str) -> str:
    return f"rq:active:{owner}"


def owner_index_key(owner: str) -> str:
    """An owner's jobs, sorted by creation (listing)."""
    return f"rq:jobs:{owner}"
