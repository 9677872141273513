"""GenerateBatches' flush rule and requeue on its own: a real Celery worker (threads pool, one
thread, as the GPU worker runs) consumes a batched task that only records the batches it is
handed. Real Redis broker; no model."""

from __future__ import annotations

import threading
import time

import pytest
from celery.contrib.testing.worker import start_worker

from domain.names import SHARED_GENERATE_QUEUE
from domain.settings import Settings
from tests.conftest import empty_db_url
from workers.celery_app import create_celery
from workers.gpu.requeue import REQUEUE
from workers.tasks.gpu_batching import GenerateBatches

TASK = "tests.gpu_batching.record"
BATCH = 4
# Long enough that a batch held for it shows in the timings; the tests never wait for it.
MAX_WAIT = 8.0

batches: list[list[str]] = []
requeued: set[str] = set()
lock = threading.Lock()


@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory):
    app = create_celery(Settings(state_dir=tmp_path_factory.mktemp("state")), empty_db_url(redis_url, 14))
    app.conf.include = []
    # Room for a running batch and two full ones behind it (the GPU worker reserves two batches).
    app.conf.worker_prefetch_multiplier = 4 * BATCH

    @app.task(name=TASK, base=GenerateBatches, bind=True, flush_every=BATCH, flush_interval=0.001)
    def record(self, requests):
        names = [request.args[0] for request in requests]
        with lock:
            batches.append(names)
        if any(name.startswith("slow") for name in names):
            time.sleep(1.0)
        first_time = [name for name in names if name.startswith("requeue") and name not in requeued]
        requeued.update(first_time)
        return REQUEUE if first_time else None

    record.max_wait = MAX_WAIT
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False,
                      queues=[SHARED_GENERATE_QUEUE], shutdown_timeout=20):
        yield app


@pytest.fixture(autouse=True)
def fresh():
    batches.clear()
    yield


def send(app, *names: str) -> None:
    with app.producer_or_acquire() as producer:
        for name in names:
            app.send_task(TASK, args=[name], queue=SHARED_GENERATE_QUEUE, producer=producer)


def wait_for_lines(count: int, timeout: float = 20.0) -> list[list[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with lock:
            if sum(len(batch) for batch in batches) >= count:
                return [list(batch) for batch in batches]
        time.sleep(0.01)
    raise AssertionError(f"timed out; batches so far: {batches}")


def busy(app, name: str) -> None:
    """Start a batch that runs for a second: what is sent meanwhile waits in the worker's buffer,
    so the next batches do not depend on how fast the messages are published."""
    with lock:
        before = sum(len(batch) for batch in batches)  # counted before sending: the batch may end at once
    send(app, name)
    wait_for_lines(before + 1)


def test_waiting_jobs_run_as_full_batches_without_the_wait(app):
    busy(app, "slow-full")
    send(app, *(f"full-{n}" for n in range(2 * BATCH)))
    started = time.monotonic()
    got = wait_for_lines(1 + 2 * BATCH)
    assert got == [["slow-full"], [f"full-{n}" for n in range(BATCH)], [f"full-{n}" for n in range(BATCH, 2 * BATCH)]]
    assert time.monotonic() - started < MAX_WAIT / 2


def test_a_partial_batch_runs_at_once_when_nothing_more_waits(app):
    started = time.monotonic()
    send(app, "partial-0")
    assert wait_for_lines(1) == [["partial-0"]]
    assert time.monotonic() - started < MAX_WAIT / 2


def test_jobs_arriving_during_a_batch_run_together_next(app):
    busy(app, "slow-0")
    send(app, "next-0", "next-1", "next-2")
    # celery-batches' own rule would flush each arrival on the next tick, as batches of one.
    assert wait_for_lines(4) == [["slow-0"], ["next-0", "next-1", "next-2"]]


def test_a_requeued_batch_comes_back(app):
    busy(app, "slow-requeue")
    send(app, "requeue-0", "requeue-1")
    got = wait_for_lines(5)
    assert got[:2] == [["slow-requeue"], ["requeue-0", "requeue-1"]]
    # Both messages run again (put back one by one, they may come back as one batch or two).
    assert sorted(name for batch in got[2:] for name in batch) == ["requeue-0", "requeue-1"]
    time.sleep(0.3)
    assert wait_for_lines(5) == got  # run once more, then acknowledged: nothing comes back again
    assert app.connection_for_read().default_channel.client.llen(SHARED_GENERATE_QUEUE) == 0
