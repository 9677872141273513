"""Submitting jobs: store the record, then enqueue its first task. Used by the API and batches."""

from __future__ import annotations

import json
from typing import Any

import redis
from celery import Celery

from engine.errors import ServiceUnavailableError
from workers.jobs.prompt_codec import text_prompt
from workers.jobs.request import JobRequest
from workers.jobs.store import JobStore
from workers.models import ModelFacts
from workers.names import GENERATE_TASK, PREPROCESS_QUEUE, PREPROCESS_TASK, SHARED_GENERATE_QUEUE


def submit_job(store: JobStore, celery: Celery, *, owner: str, request: JobRequest,
               extra: dict[str, str] | None = None, model: ModelFacts | None = None,
               watched: bool = False) -> dict[str, Any]:
    """Create the job and enqueue its first task; returns the stored job record. ``watched``: the
    caller streams the job's events from the start.

    A prompt of plain token ids (no media, no media tokens; the token-in-token-out path RL
    trainers use most) needs no processor: it goes straight to the GPU queue, skipping a Celery
    hop. Everything else is preprocessed by a CPU worker first.
    """
    token_ids = request.token_ids
    plain = bool(model is not None and token_ids and not request.has_media and model.is_plain_text(token_ids))
    job = store.create(
        owner=owner,
        kind=request.kind,
        request=request.to_record(),
        request_id=request.request_id,
        webhook=request.webhook,
        metadata=request.metadata,
        extra=extra,
        prompt=json.dumps(text_prompt(token_ids)) if plain else None,
        watched=watched,
    )
    try:
        if plain:
            celery.send_task(GENERATE_TASK, args=[job["id"]], queue=SHARED_GENERATE_QUEUE)
        else:
            enqueue_preprocess(celery, job["id"])
    except Exception:
        # The client gets an error (503 when Redis is away): the job must not linger as queued,
        # holding a place under the queue caps. Best effort: the store may be away too.
        try:
            store.fail(job["id"], ServiceUnavailableError("the job could not be queued"))
        except redis.RedisError:
            pass
        raise
    return job


def enqueue_preprocess(celery: Celery, job_id: str, *, retry_handles: bool = False) -> None:
    celery.send_task(PREPROCESS_TASK, args=[job_id], kwargs={"retry_handles": retry_handles}, queue=PREPROCESS_QUEUE)
