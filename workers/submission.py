"""Submitting jobs: store the record, then enqueue its first task. Used by the API and batches."""

from __future__ import annotations

from typing import Any

from celery import Celery

from workers.celery_app import PREPROCESS_QUEUE
from workers.job_store import JobStore

PREPROCESS_TASK = "rollout.preprocess"


def submit_job(store: JobStore, celery: Celery, *, owner: str, request: dict[str, Any],
               extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Create the job and enqueue its preprocessing; returns the stored job record."""
    job = store.create(
        owner=owner,
        kind=request.get("kind", "generate"),
        request=request,
        request_id=request.get("request_id"),
        webhook=request.get("webhook"),
        metadata=request.get("metadata"),
        extra=extra,
    )
    enqueue_preprocess(celery, job["id"])
    return job


def enqueue_preprocess(celery: Celery, job_id: str, *, retry_handles: bool = False) -> None:
    celery.send_task(PREPROCESS_TASK, args=[job_id], kwargs={"retry_handles": retry_handles}, queue=PREPROCESS_QUEUE)
