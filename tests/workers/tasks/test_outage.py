"""A task that meets a Redis outage puts its message back instead of failing it (Celery would
acknowledge a failed task's message, and that work would be lost): workers/tasks/outage.py.

Each task runs in this process against a Redis port nothing listens on (a real refused
connection), the way a worker runs it while Redis restarts."""

from __future__ import annotations

import pytest
from celery.exceptions import Reject

from domain.infra.redis_server import free_port
from domain.names import (
    CANCEL_BATCH_TASK,
    DELIVER_TASK,
    ENQUEUE_CHUNK_TASK,
    EXPIRE_BATCH_TASK,
    JOB_ENDED_TASK,
    PREPROCESS_TASK,
    RENDER_TASK,
    SCORE_LINES_TASK,
)
from domain.settings import Settings
from workers.celery_app import create_celery


@pytest.fixture
def app_without_redis(tmp_path):
    app = create_celery(Settings(state_dir=tmp_path), f"redis://127.0.0.1:{free_port()}/0")
    app.loader.import_default_modules()
    return app


@pytest.mark.parametrize(("task", "args"), [
    (JOB_ENDED_TASK, ["job_0123456789abcdefghijkl"]),
    (DELIVER_TASK, ["evt_0123456789abcdefghijkl"]),
    (PREPROCESS_TASK, ["job_0123456789abcdefghijkl"]),
    (RENDER_TASK, ["render_0123456789abcdefghijkl"]),
    (SCORE_LINES_TASK, ["batch_0123456789abcdefghijkl", 0]),
    (ENQUEUE_CHUNK_TASK, ["batch_0123456789abcdefghijkl", 0]),
    (CANCEL_BATCH_TASK, ["batch_0123456789abcdefghijkl"]),
    (EXPIRE_BATCH_TASK, ["batch_0123456789abcdefghijkl"]),
])
def test_a_task_that_meets_a_redis_outage_requeues_its_message(app_without_redis, task, args):
    with pytest.raises(Reject) as rejected:
        app_without_redis.tasks[task](*args)
    assert rejected.value.requeue is True
