"""Key B's place behind key A's deep backlog in the GPU intake (issue #56 item 3; the order:
``domain/infra/intake_order.py``).

Key A's bulk of 1,000 generate messages is sent as a bulk submit sends it (``send_placed`` in one
publish batch), then key B's one message; a consumer with a GPU worker's prefetch window (two
batches at the defaults) takes them with the service's transport (workers/celery_transport.py) and
acknowledges each as it comes. Reported: how many of A's messages it takes before B's, with the
messages ranked by their key's depth (now) and all at one step (before: one FIFO list per queue,
what every message got); B's wait is that many of A's jobs run first (the worker's scheduler then
shares the rows between what it reserved). Beside them what ranking costs a send: the round trip
that numbers a bulk's messages.

    python -m bench.intake_order
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import redis
from kombu import Consumer, Exchange, Queue

from bench.rows import print_rows
from domain.infra.gpu_affinity import Placement
from domain.infra.intake_order import intake_marks
from domain.infra.redis_server import EmbeddedRedis
from domain.jobs.submission import send_generate, send_placed
from domain.names import SHARED_GENERATE_QUEUE
from domain.settings import Settings
from workers.celery_app import create_celery

BACKLOG = 1000
ROUNDS = 5


def placement(owner: str, n: int) -> Placement:
    return Placement(f"job_{owner}{n:0>{22 - len(owner)}}", [1, 2, 3], owner, owner=owner)


def send(app, client, placements: list[Placement], *, ranked: bool) -> None:
    with app.producer_or_acquire() as producer, producer.batch():
        if ranked:
            send_placed(app, client, placements, producer=producer)
        else:  # before: every generate message at one step, in one FIFO list
            for place in placements:
                send_generate(app, place.job_id, queue=SHARED_GENERATE_QUEUE, producer=producer)


def taken_before(app, window: int, target: str, total: int) -> int:
    """How many messages the consumer takes before ``target`` (then it takes the rest)."""
    order: list[str] = []

    def on_message(body, message):
        order.append(json.loads(message.headers["argsrepr"].replace("'", '"'))[0])
        message.ack()

    queue = Queue(SHARED_GENERATE_QUEUE, Exchange(SHARED_GENERATE_QUEUE, type="direct"), routing_key=SHARED_GENERATE_QUEUE)
    with app.connection_for_read() as connection:
        consumer = Consumer(connection.default_channel, [queue], callbacks=[on_message], accept=["json"])
        consumer.qos(prefetch_count=window)
        with consumer:
            while len(order) < total:
                connection.drain_events(timeout=5)
    return order.index(target)


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", persistent=False).start()
        try:
            settings = Settings(state_dir=Path(tmp) / "state", gpu_affinity=False)
            app = create_celery(settings, server.url)
            window = 2 * settings.batch_rows
            client = redis.Redis.from_url(server.url)
            backlog = [placement("a", i) for i in range(BACKLOG)]
            b = placement("b", 0)
            positions = {}
            for ranked in (False, True):
                client.flushdb()
                send(app, client, backlog, ranked=ranked)
                send(app, client, [b], ranked=ranked)
                positions[ranked] = taken_before(app, window, b.job_id, BACKLOG + 1)
            bulk, single = [], []
            for _ in range(ROUNDS):
                started = time.perf_counter()
                intake_marks(client, ["a"] * BACKLOG, window=window)
                bulk.append(time.perf_counter() - started)
                started = time.perf_counter()
                intake_marks(client, ["b"], window=window)
                single.append(time.perf_counter() - started)
            client.close()
        finally:
            server.stop()
    before, after = positions[False], positions[True]
    return [
        {"name": f"intake: key A's messages taken before key B's one, A's backlog {BACKLOG:,}, window {window}, "
                 "all at one step (before)", "value": before, "goal": None},
        {"name": "intake: the same, ranked by each key's depth (now)", "value": after, "goal": f"<= {window}"},
        {"name": f"intake: numbering a bulk of {BACKLOG:,} messages, one round trip, median (ms)",
         "value": round(statistics.median(bulk) * 1000, 2), "goal": None},
        {"name": "intake: numbering one message, median (us)", "value": round(statistics.median(single) * 1e6),
         "goal": None},
    ]


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
