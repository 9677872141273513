"""Submitting jobs: store the record, then enqueue its first task. Used by the API and batches.

One message per job, also for a batch chunk's jobs and a bulk submit's (``submit_jobs`` creates them
in one round trip and sends their messages in one more):
a GPU worker reserves messages, not jobs, so a message naming many jobs would let the first worker
to reserve hold a whole batch while the fleet's others idle.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import BatchPublishError, OperationalError

from domain.infra.gpu_affinity import GpuRouter, Placement
from domain.infra.intake_order import MARK_HEADER, intake_marks
from domain.infra.redis_records import new_id
from domain.jobs.prompt_codec import text_prompt
from domain.jobs.request import JobRequest
from domain.jobs.store import JobStore, NewJob, QueueFullError
from domain.models import ModelFacts
from domain.names import GENERATE_TASK, PREPROCESS_QUEUE, PREPROCESS_TASK, SHARED_GENERATE_QUEUE
from engine.errors import ServiceUnavailableError
from engine.limits import Limits
from engine.result_bound import request_result_bound


def submit_job(store: JobStore, celery: Celery, *, owner: str, request: JobRequest,
               extra: dict[str, str] | None = None, model: ModelFacts | None = None,
               watched: bool = False, job_id: str | None = None) -> dict[str, Any]:
    """Create the job and enqueue its first task; returns the stored job record. ``watched``: the
    caller streams the job's events from the start.

    A prompt of plain token ids (no media, no media tokens; the token-in-token-out path RL
    trainers use most) needs no processor: it goes straight to the GPU queue, skipping a Celery
    hop. Everything else is preprocessed by a CPU worker first. ``job_id``: the id to make it
    under (made beforehand by :func:`new_job_ids`); a new one by default.
    """
    plain = _is_plain(request, model)
    job = store.add(_new_job(owner, request, extra, plain, watched, job_id))
    try:
        if plain:
            send_placed(celery, store.redis, [placement(job["id"], owner, request, request.token_ids)])
        else:
            enqueue_preprocess(celery, job["id"])
    except Exception:
        _fail_unqueued(store, [job["id"]])
        raise
    return job


def submit_jobs(store: JobStore, celery: Celery, *, owner: str,
                requests: list[tuple[JobRequest, dict[str, str] | None]],
                model: ModelFacts | None = None, job_ids: Sequence[str] | None = None,
                ) -> list[dict[str, Any] | QueueFullError]:
    """``submit_job`` for many ``(request, extra)`` of one owner (a batch's chunk): created in one
    round trip, their messages sent through one producer. Each one's record, or the
    QueueFullError it met. ``job_ids``: the ids to make them under, one each (:func:`new_job_ids`)."""
    plain = [_is_plain(request, model) for request, _ in requests]
    ids = list(job_ids) if job_ids is not None else [None] * len(requests)
    outcomes = store.create_many([_new_job(owner, request, extra, is_plain, job_id=job_id)
                                  for (request, extra), is_plain, job_id in zip(requests, plain, ids, strict=True)])
    created = [(job["id"], is_plain) for job, is_plain in zip(outcomes, plain, strict=True)
               if not isinstance(job, QueueFullError)]
    try:
        # kombu's publish batch: the messages' LPUSHes go to Redis in one pipeline when the block
        # ends (one round trip, where each publish was one). A batch that fails is "uncertain": some
        # messages may be in; every job is failed, and a worker handed one of them settles it unrun.
        plain_jobs = [placement(job["id"], owner, request, request.token_ids)
                      for job, (request, _), is_plain in zip(outcomes, requests, plain, strict=True)
                      if is_plain and not isinstance(job, QueueFullError)]
        with celery.producer_or_acquire() as producer, producer.batch():
            send_placed(celery, store.redis, plain_jobs, producer=producer)
            for job_id, is_plain in created:
                if not is_plain:
                    enqueue_preprocess(celery, job_id, producer=producer)
    except Exception as error:
        _fail_unqueued(store, [job_id for job_id, _ in created])
        if isinstance(error, BatchPublishError):  # what every caller knows a failed publish by
            raise OperationalError("the jobs' messages could not be published") from error
        raise
    return outcomes


def send_generate(celery: Celery, job_id: str, *, queue: str = SHARED_GENERATE_QUEUE, producer=None,
                  step: int = 0, mark: list | None = None) -> None:
    """``step``: its priority step in the queue, ``mark`` its key's number (domain/infra/intake_order.py)."""
    celery.send_task(GENERATE_TASK, args=[job_id], queue=queue, producer=producer, priority=step or None,
                     headers={MARK_HEADER: mark} if mark is not None else None)


def placement(job_id: str, owner: str, request: JobRequest, token_ids: Sequence[int], *,
              media: Sequence[tuple[int, str]] = (), transport: str = "inline", node_id: str = "") -> Placement:
    """A generate message to place on the GPU worker that holds its prefix: its prompt as the
    engine sees it, in its caller's cache scope; handles keep it on ``node_id``."""
    return Placement(job_id, token_ids, request.cache_scope(owner), media, node_id if transport != "inline" else None,
                     session=request.session_id, owner=owner)


def send_placed(celery: Celery, client: redis.Redis, placements: Sequence[Placement], *, producer=None) -> None:
    """Each job's generate message to the queue its prefix chooses (``domain/infra/gpu_affinity.py``;
    with ``ROLLOUT_GPU_AFFINITY`` off, its node's or the shared queue), at its key's place in the
    intake (``domain/infra/intake_order.py``; the window a GPU worker's prefetch)."""
    settings = celery.rollout_settings
    if settings.gpu_affinity:
        queues = GpuRouter(client).queues(placements)
    else:
        queues = [place.fallback_queue for place in placements]
    marks = intake_marks(client, [place.owner for place in placements], window=2 * settings.batch_rows)
    for place, queue, mark in zip(placements, queues, marks, strict=True):
        step, number = mark if mark is not None else (0, None)
        send_generate(celery, place.job_id, queue=queue, producer=producer, step=step, mark=number)


def _is_plain(request: JobRequest, model: ModelFacts | None) -> bool:
    token_ids = request.token_ids
    return bool(model is not None and token_ids and not request.has_media and model.is_plain_text(token_ids))


def new_job_ids(count: int) -> list[str]:
    """Ids for jobs not made yet: what is reserved for them is keyed by them before they exist."""
    return [new_id("job") for _ in range(count)]


def result_reservations(job_ids: Sequence[str], requests: Sequence[JobRequest], *, limits: Limits,
                        vocab_size: int | None, watched: bool = False,
                        routed_bytes_per_token: int = 0) -> list[tuple[str, int]]:
    """``(job id, bytes)`` of each job's result bound (engine/result_bound.py) as admission reserves
    it (domain/infra/redis_reservations.py): twice for a streamed job, whose tokens its events hold too."""
    times = 2 if watched else 1
    return [(job_id, times * request_result_bound(request.to_record(), context_tokens=limits.context_tokens,
                                                  vocab_size=vocab_size, routed_bytes_per_token=routed_bytes_per_token))
            for job_id, request in zip(job_ids, requests, strict=True)]


def _new_job(owner: str, request: JobRequest, extra: dict[str, str] | None, plain: bool,
             watched: bool = False, job_id: str | None = None) -> NewJob:
    return NewJob(owner=owner, kind=request.kind, request=request.to_record(), request_id=request.request_id,
                  webhook=request.webhook, metadata=request.metadata, extra=extra,
                  prompt=json.dumps(text_prompt(request.token_ids)) if plain else None, watched=watched,
                  job_id=job_id)


def _fail_unqueued(store: JobStore, job_ids: list[str]) -> None:
    """The client gets an error (503 when Redis is away): jobs whose message was not sent must not
    linger as queued, holding places under the queue caps. Best effort: the store may be away too."""
    for job_id in job_ids:
        try:
            store.fail(job_id, ServiceUnavailableError("the job could not be queued"))
        except redis.RedisError:
            return


def enqueue_preprocess(celery: Celery, job_id: str, *, retry_handles: bool = False, producer=None) -> None:
    celery.send_task(PREPROCESS_TASK, args=[job_id], kwargs={"retry_handles": retry_handles}, queue=PREPROCESS_QUEUE,
                     producer=producer)
