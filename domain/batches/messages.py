"""The messages that start and stop a batch's work (the tasks: ``workers/tasks/batches.py``).

The API sends them when a batch is made or cancelled, the chunk task sends scoring runs, the expiry
check re-arms itself, and the batch reaper (``domain/batches/reaper.py``) sends again what a crash
lost; apart from the tasks so that none of those imports a task module.
"""

from __future__ import annotations

from collections.abc import Iterable

from celery import Celery
from kombu.exceptions import BatchPublishError, OperationalError

from domain.names import (
    BATCHES_QUEUE,
    CANCEL_BATCH_TASK,
    ENQUEUE_CHUNK_TASK,
    EXPIRE_BATCH_TASK,
    SCORE_LINES_TASK,
    SHARED_GENERATE_QUEUE,
)
from domain.settings import Settings


def send_chunks(celery: Celery, batch_id: str, chunks: Iterable[int]) -> None:
    """One message per chunk given, in one pipeline (kombu's publish batch: one round trip where
    each publish was one). A batch that fails may have sent some of them: a chunk task run twice is
    a no-op, and the batch reaper sends what none carries (domain/batches/reaper.py). It is raised
    as kombu's OperationalError, what every caller knows a failed publish by."""
    try:
        with celery.producer_or_acquire() as producer, producer.batch():
            for index in chunks:
                send_chunk(celery, batch_id, index, producer=producer)
    except BatchPublishError as error:
        raise OperationalError(f"batch {batch_id}: its chunks' messages could not be published") from error


def schedule_expiry(celery: Celery, settings: Settings, batch_id: str, seconds: float) -> None:
    # The check re-arms itself in steps shorter than the broker's visibility timeout: Redis would
    # redeliver (and so duplicate) a message whose countdown is longer than that.
    countdown = max(1.0, min(seconds, settings.visibility_timeout / 2))
    celery.send_task(EXPIRE_BATCH_TASK, args=[batch_id], queue=BATCHES_QUEUE, countdown=countdown)


def request_cancel(celery: Celery, batch_id: str) -> None:
    celery.send_task(CANCEL_BATCH_TASK, args=[batch_id], queue=BATCHES_QUEUE)


def send_chunk(celery: Celery, batch_id: str, index: int, *, producer=None) -> None:
    celery.send_task(ENQUEUE_CHUNK_TASK, args=[batch_id, index], queue=BATCHES_QUEUE, producer=producer)


def send_score_lines(celery: Celery, batch_id: str, index: int) -> None:
    # On the shared generate queue: any GPU worker scores them, beside its generation batches.
    celery.send_task(SCORE_LINES_TASK, args=[batch_id, index], queue=SHARED_GENERATE_QUEUE)
