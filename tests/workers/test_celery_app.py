"""The Celery app (workers/celery_app.py): its disabled backend built once for every thread
(Celery builds one per thread, scanning entry points each time), messages reach their queues
without declaring them on every send, and a sweep that died does not stop held messages coming back."""

from __future__ import annotations

import threading
import time

import redis
from celery.backends.base import DisabledBackend

from domain.names import PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE
from domain.settings import Settings
from tests.conftest import empty_db_url
from workers.celery_app import create_celery, restore_interval


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


def test_a_restore_lock_left_by_a_sweep_that_died_lapses_after_three_sweep_intervals(redis_url):
    """kombu's sweep of held messages runs under a lock it keeps 300 s unless released; a sweep cut
    off by a failover left every held message where it was for five minutes."""
    url = empty_db_url(redis_url, 23)
    settings = Settings(redis_url=url, visibility_timeout=5, task_time_limit=2, task_soft_time_limit=1)
    app = create_celery(settings, url)
    app.send_task("rollout.generate", args=["job_x"], queue=SHARED_GENERATE_QUEUE)
    with app.connection_for_write() as connection, redis.Redis.from_url(url) as client:
        channel = connection.default_channel
        held = channel.basic_get(SHARED_GENERATE_QUEUE, no_ack=False)  # recorded as unacknowledged
        assert held is not None and client.llen(SHARED_GENERATE_QUEUE) == 0
        client.zadd("unacked_index", {held.delivery_tag: time.time() - 60})  # held past the timeout
        # The lock of a sweep that died mid-way, as kombu takes it (redis-py's Lock: SET NX PX).
        expire = channel.unacked_mutex_expire
        assert expire == 3 * restore_interval(settings) == 3
        assert client.set("unacked_mutex", "a dead sweep", nx=True, px=int(expire * 1000))
        channel.qos.restore_visible(num=None, interval=1)
        assert client.llen(SHARED_GENERATE_QUEUE) == 0  # the lock holds
        time.sleep(expire + 0.2)
        channel.qos.restore_visible(num=None, interval=1)
        assert client.llen(SHARED_GENERATE_QUEUE) == 1 and client.hlen("unacked") == 0
