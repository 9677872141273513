"""Which unacknowledged messages no live worker of their kind holds (workers/held_messages.py), on a
real Redis laid out as kombu's Redis transport lays it out (``unacked`` hash, ``unacked_index``); and,
for each kind of worker, a real worker's heartbeat lists a countdown retry it holds, which a sweep
leaves to it and gives back at once when the worker is killed."""

from __future__ import annotations

import json
import signal
import time

import pytest
from kombu.transport.redis import Channel

from domain.infra.heartbeats import beat
from domain.names import (
    BATCHES_QUEUE,
    DELIVER_TASK,
    ENQUEUE_CHUNK_TASK,
    GENERATE_TASK,
    JOB_ENDED_TASK,
    PREPROCESS_QUEUE,
    PREPROCESS_TASK,
    SCORE_LINES_TASK,
    SHARED_GENERATE_QUEUE,
    WEBHOOKS_QUEUE,
)
from tests.conftest import empty_db_url
from workers.held_messages import MARGIN_S, orphaned_messages

pytestmark = pytest.mark.stack  # real workers in subprocesses, killed (README "Tests")


@pytest.fixture
def client(redis_url):
    import redis

    with redis.Redis.from_url(empty_db_url(redis_url, 21)) as client:
        yield client


def _unacked(client, tag: str, task: str, reserved_at: float) -> None:
    message = {"headers": {"task": task, "argsrepr": "('job_x',)"}, "body": "", "properties": {}}
    client.hset(Channel.unacked_key, tag, json.dumps([message, "", "generate.shared"]))
    client.zadd(Channel.unacked_index_key, {tag: reserved_at})


def _beat(client, name: str, at: float, held: list[str]) -> None:
    beat(client, "gpu", name, {"at": at, "model_ready": True, "held": held})


def test_only_generate_messages_no_live_worker_holds_and_reported_since_are_orphans(client):
    now = 1_000_000.0
    _unacked(client, "held", GENERATE_TASK, now - 60)
    _unacked(client, "orphan", GENERATE_TASK, now - 60)
    _unacked(client, "just-reserved", GENERATE_TASK, now - 1)  # a live worker may not have reported it yet
    _unacked(client, "a-cpu-task", PREPROCESS_TASK, now - 60)  # not ours to restore
    _beat(client, "gpu-1", now - 0.5, ["held"])
    _beat(client, "gpu-2", now - 1.0, [])
    assert orphaned_messages(client, "gpu", {GENERATE_TASK}, now=now) == ["orphan"]


def test_with_no_live_gpu_worker_every_generate_message_past_the_margin_is_an_orphan(client):
    now = 1_000_000.0
    _unacked(client, "a", GENERATE_TASK, now - MARGIN_S - 1)
    _unacked(client, "b", GENERATE_TASK, now - 0.1)
    assert orphaned_messages(client, "gpu", {GENERATE_TASK}, now=now) == ["a"]


def test_a_worker_that_has_not_beaten_since_a_reservation_protects_it(client):
    now = 1_000_000.0
    _unacked(client, "maybe-gpu-1s", GENERATE_TASK, now - 10)
    _beat(client, "gpu-1", now - 9, [])  # beat after the reservation, but within the margin of it
    assert orphaned_messages(client, "gpu", {GENERATE_TASK}, now=now) == []


def test_a_webhooks_worker_lists_the_messages_of_every_kind_of_webhook_task_it_holds(client):
    now = 1_000_000.0
    _unacked(client, "an-end", JOB_ENDED_TASK, now - 60)
    _unacked(client, "a-retry", DELIVER_TASK, now - 60)
    _unacked(client, "a-generate", GENERATE_TASK, now - 60)  # the GPU sweep's
    beat(client, "webhooks", "webhooks-1", {"at": now - 0.5, "held": ["a-retry"]})
    assert orphaned_messages(client, "webhooks", {JOB_ENDED_TASK, DELIVER_TASK}, now=now) == ["an-end"]


def _heartbeats(client, kind: str) -> dict[str, dict]:
    return {key.decode(): json.loads(client.get(key)) for key in client.scan_iter(f"rq:worker:{kind}:*")}


def _wait(what: str, predicate, workers, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        for worker in workers:
            assert worker.poll() is None, f"a worker exited: {worker.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


# (kind, a task its workers take, its args, its queue, what the workers need for the test). Each is
# sent with a countdown: Celery holds it in the consumer's timer, not as reserved, until it is due.
KILLED_HOLDERS = [
    pytest.param("webhooks", DELIVER_TASK, ["msg_nosuchevent"], WEBHOOKS_QUEUE,
                 {"ROLLOUT_WEBHOOK_CONCURRENCY": "2"}, id="webhooks"),
    pytest.param("batches", ENQUEUE_CHUNK_TASK, ["batch_nosuchbatch", 0], BATCHES_QUEUE, {}, id="batches"),
    # A prefork worker: its main process holds the message, and must list it.
    pytest.param("cpu", PREPROCESS_TASK, ["job_nosuchjob"], PREPROCESS_QUEUE,
                 {"ROLLOUT_CPU_CONCURRENCY": "1", "ROLLOUT_SHM_POOL_BYTES": str(8 * 1024 * 1024)}, id="cpu"),
    # A GPU worker's scoring runs are Celery's own requests, beside the generate messages it batches.
    pytest.param("gpu", SCORE_LINES_TASK, ["batch_nosuchbatch", 0], SHARED_GENERATE_QUEUE,
                 {"ROLLOUT_TORCH_THREADS": "1", "ROLLOUT_KV_CACHE_TOKENS": "4096"}, id="gpu"),
]


@pytest.mark.parametrize(("kind", "task", "args", "queue", "extra_env"), KILLED_HOLDERS)
def test_a_killed_workers_countdown_retry_goes_back_at_once_to_a_live_worker(kind, task, args, queue, extra_env,
                                                                            redis_url, demo_model_dir, tmp_path):
    import redis

    from domain.settings import Settings
    from tests.worker_forks import start_worker
    from tests.workers.test_worker_start import worker_env
    from workers.celery_app import create_celery

    # A visibility timeout far beyond the test: only the sweep can give the message back in time.
    env = worker_env(redis_url, demo_model_dir, tmp_path, ROLLOUT_VISIBILITY_TIMEOUT="3600", **extra_env)
    url = env["ROLLOUT_REDIS_URL"]
    workers = []

    def start():
        worker = start_worker(kind, env)
        workers.append(worker)
        return worker

    with redis.Redis.from_url(url) as db:
        try:
            first = start()
            _wait("the first worker's heartbeat", lambda: _heartbeats(db, kind), workers)
            create_celery(Settings(), url).send_task(task, args=args, queue=queue, countdown=600)
            tag = _wait("the retry to be held", lambda: [t.decode() for t in db.hkeys(Channel.unacked_key)], workers)[0]
            _wait("the holder's heartbeat to list it",
                  lambda: any(tag in beat.get("held", ()) for beat in _heartbeats(db, kind).values()), workers)
            second = start()
            _wait("two heartbeats", lambda: len(_heartbeats(db, kind)) == 2, workers, timeout=90)
            time.sleep(MARGIN_S + 2)  # sweeps ran past the margin: a held message stays where it is
            holders = [key for key, beat in _heartbeats(db, kind).items() if tag in beat.get("held", ())]
            assert len(holders) == 1
            assert str(first.pid) in holders[0]
            first.kill()  # a prefork worker's pool process outlives it: the message is the main process's
            first.wait(timeout=30)
            # Its heartbeat expires (10 s), then a sweep gives the message back, and the live worker takes it.
            _wait("the live worker to hold the dead one's retry",
                  lambda: any(tag in beat.get("held", ()) and str(second.pid) in key
                              for key, beat in _heartbeats(db, kind).items()), workers[1:], timeout=45)
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=60)
