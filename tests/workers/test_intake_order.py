"""The GPU intake is fair between keys (issue #56 item 3; domain/infra/intake_order.py): key A's
backlog deeper than a GPU worker's window does not sit ahead of key B's message. The messages are
sent as the service sends them (``send_placed``, a bulk in one publish batch) into a real Redis, and
taken by the service's own transport (workers/celery_transport.py: BRPOP, then the burst take) with
a GPU worker's prefetch window, on its generate queues."""

from __future__ import annotations

import json

import pytest
import redis
from kombu import Consumer, Exchange, Queue

from domain.infra.gpu_affinity import Placement
from domain.infra.intake_order import SENT_KEY, TAKEN_KEY, queue_lists, waiting
from domain.infra.lost_messages import ids_in_messages
from domain.infra.metrics import snapshot
from domain.jobs.reaper import _JOB_ID
from domain.jobs.submission import send_placed
from domain.names import SHARED_GENERATE_QUEUE, node_generate_queue
from domain.settings import Settings
from tests.conftest import empty_db_url
from workers.celery_app import create_celery

ROWS = 2
WINDOW = 2 * ROWS  # a GPU worker's prefetch
NODE_QUEUE = node_generate_queue("intake-node")


@pytest.fixture
def app(redis_url, tmp_path):
    url = empty_db_url(redis_url, 24)
    settings = Settings(state_dir=tmp_path, gpu_batch_size=ROWS, gpu_affinity=False, node_id="intake-node")
    app = create_celery(settings, url)
    with redis.Redis.from_url(url) as client:
        client.flushdb()
        app.test_client = client
        yield app


def job(owner: str, n: int, node: str | None = None) -> Placement:
    return Placement(f"job_{owner}{n:0>{22 - len(owner)}}", [1, 2, 3], owner, node=node, owner=owner)


def send(app, placements: list[Placement]) -> None:
    """As a bulk submit sends: one publish batch, its LPUSHes in one pipeline."""
    with app.producer_or_acquire() as producer, producer.batch():
        send_placed(app, app.test_client, placements, producer=producer)


def take(app, count: int, *, ack_after: int = 0, prefetch: int = WINDOW) -> list[str]:
    """The job ids a GPU worker's consumer (prefetch: its window) is handed, in order, acknowledging
    each as it comes (after the first ``ack_after``, which it holds: a window a running batch keeps)."""
    order: list[str] = []
    held = []

    def on_message(body, message):
        order.append(json.loads(message.headers["argsrepr"].replace("'", '"'))[0])
        if len(order) <= ack_after:
            held.append(message)
        else:
            message.ack()

    queues = [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in (SHARED_GENERATE_QUEUE,
                                                                                         NODE_QUEUE)]
    with app.connection_for_read() as connection:
        consumer = Consumer(connection.default_channel, queues, callbacks=[on_message], accept=["json"])
        consumer.qos(prefetch_count=prefetch)
        with consumer:
            while len(order) < count:
                connection.drain_events(timeout=5)
        for message in held:
            message.ack()
    return order


def test_another_keys_message_is_taken_before_the_rest_of_a_deep_backlog(app):
    backlog = [job("a", i) for i in range(3 * WINDOW + 2)]
    send(app, backlog)
    send(app, [job("b", 0)])
    order = take(app, len(backlog) + 1)
    # B's message goes after A's first window (A's messages before B's at step 0), not after A's 14.
    assert order[WINDOW] == job("b", 0).job_id
    assert [o for o in order if o.startswith("job_a")] == [p.job_id for p in backlog]  # A's in its own order


def test_it_goes_ahead_across_queues_within_one_burst_take(app):
    """A's backlog in the shared queue, B's message in its node's: the burst take that follows one
    BRPOP (of A's first) takes B's before A's second window, in the same script."""
    backlog = [job("a", i) for i in range(3 * WINDOW)]
    send(app, backlog)
    send(app, [job("b", 0, node="intake-node")])
    order = take(app, 2 * WINDOW, ack_after=2 * WINDOW, prefetch=2 * WINDOW)  # one wake-up fills it
    # B's among A's step 0 (the queues taken in kombu's round-robin order), all before A's step 1.
    assert job("b", 0).job_id in order[:WINDOW + 1]
    assert [o for o in order if o.startswith("job_a")] == [p.job_id for p in backlog[:2 * WINDOW - 1]]


def test_a_keys_depth_follows_what_workers_took(app):
    send(app, [job("a", i) for i in range(3 * WINDOW)])
    assert waiting(app.test_client, [SHARED_GENERATE_QUEUE]) == [3 * WINDOW]
    assert snapshot(app.test_client, [SHARED_GENERATE_QUEUE]).queue_depths == {SHARED_GENERATE_QUEUE: 3 * WINDOW}
    assert [app.test_client.llen(name) for name in queue_lists(SHARED_GENERATE_QUEUE)[:4]] == [WINDOW] * 3 + [0]
    take(app, 2 * WINDOW)
    assert int(app.test_client.hget(TAKEN_KEY, "a")) == 2 * WINDOW  # the highest number taken
    send(app, [job("a", 100)])  # A's depth: its last window still queued, so its next step
    assert app.test_client.llen(queue_lists(SHARED_GENERATE_QUEUE)[1]) == 1
    take(app, WINDOW + 1)
    send(app, [job("a", 101)])  # nothing of A's queued: its first step again
    assert app.test_client.llen(SHARED_GENERATE_QUEUE) == 1


def test_a_number_from_before_the_counts_lapsed_is_ignored(app):
    send(app, [job("a", i) for i in range(2 * WINDOW)])
    app.test_client.delete(SENT_KEY, TAKEN_KEY)  # the counts lapsed with messages still queued
    send(app, [job("a", 99)])  # numbered 1 again
    take(app, 2 * WINDOW + 1)
    assert int(app.test_client.hget(TAKEN_KEY, "a")) == 1  # not 8: A's next messages are not sent shallow


def test_every_list_of_a_queue_is_looked_in_for_lost_messages(app):
    backlog = [job("a", i) for i in range(3 * WINDOW)]
    send(app, backlog)
    assert ids_in_messages(app.test_client, _JOB_ID, queues=[SHARED_GENERATE_QUEUE]) == {p.job_id for p in backlog}


def test_a_held_message_restored_goes_back_to_its_step(app):
    """What kombu's restores (the held-message sweep's ``restore_by_tag``, a rejected message, the
    visibility sweep) put back keeps the message's step: it is in its properties."""
    send(app, [job("a", i) for i in range(2 * WINDOW)])
    with app.connection_for_read() as connection:
        queue = Queue(SHARED_GENERATE_QUEUE, Exchange(SHARED_GENERATE_QUEUE, type="direct"),
                      routing_key=SHARED_GENERATE_QUEUE)
        taken = []
        consumer = Consumer(connection.default_channel, [queue], accept=["json"],
                            callbacks=[lambda body, message: taken.append(message)])
        consumer.qos(prefetch_count=2 * WINDOW)
        with consumer:
            while len(taken) < 2 * WINDOW:
                connection.drain_events(timeout=5)
            assert waiting(app.test_client, [SHARED_GENERATE_QUEUE]) == [0]
            qos = connection.default_channel.qos
            for message in taken[WINDOW - 1:WINDOW + 1]:  # A's last at step 0 and first at step 1
                qos.restore_by_tag(message.delivery_tag)
            client = app.test_client
            assert [client.llen(name) for name in queue_lists(SHARED_GENERATE_QUEUE)[:3]] == [1, 1, 0]
            for message in taken[:WINDOW - 1] + taken[WINDOW + 1:]:
                message.ack()
