"""The Celery app (workers/celery_app.py): its disabled backend built once for every thread
(Celery builds one per thread, scanning entry points each time), and messages reach their queues
without declaring them on every send."""

from __future__ import annotations

import threading

import redis
from celery.backends.base import DisabledBackend

from tests.conftest import empty_db_url
from workers.celery_app import create_celery
from workers.names import PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE
from workers.settings import Settings


def test_every_thread_shares_one_disabled_backend_and_tasks_reach_undeclared_queues(redis_url):
    url = empty_db_url(redis_url, 23)
    app = create_celery(Settings(redis_url=url), url)
    backends = []
    threads = [threading.Thread(target=lambda: backends.append(app.backend)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(backend) for backend in backends}) == 1 and isinstance(backends[0], DisabledBackend)
    app.send_task("rollout.generate", args=["job_x"], queue=SHARED_GENERATE_QUEUE)
    app.send_task("rollout.preprocess", args=["job_y"], queue=PREPROCESS_QUEUE, countdown=0)
    with redis.Redis.from_url(url) as client:  # a Redis no worker declared a queue in: no bindings
        assert not client.keys("_kombu.binding.*")
        assert client.llen(SHARED_GENERATE_QUEUE) == 1 and client.llen(PREPROCESS_QUEUE) == 1
