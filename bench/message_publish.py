"""Sending a task message: kombu's Redis transport beside ours (workers/celery_transport.py).

Every job's submit sends one Celery message (``send_task``) and every task's end acknowledges
one; kombu's Redis channel builds a new ``redis.Redis`` for each such call, ours keeps one per
channel. Two Celery apps on one embedded Redis, alike but for the transport, send the same
preprocess task in turn (rounds alternated, the best of three each); reported: the sender's
time per message with each, and their ratio. Then a batch file's chunk messages as the API sends
them, in one publish batch, beside the same sent one at a time.

Run: ``python -m bench.message_publish`` from the repository root (about 10 s).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from kombu.transport import redis as kombu_redis

from bench.rows import print_rows
from domain.batches.messages import send_chunk, send_chunks
from domain.infra.redis_server import EmbeddedRedis
from domain.names import PREPROCESS_QUEUE, PREPROCESS_TASK
from domain.settings import Settings
from workers.celery_app import create_celery

MESSAGES = 2000
CHUNKS = 32  # bench.service's 2,000 score rows at the default chunk size (64)


def run(messages: int = MESSAGES, rounds: int = 3) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", persistent=False).start()
        try:
            ours = create_celery(Settings(state_dir=Path(tmp)), server.url)
            stock = create_celery(Settings(state_dir=Path(tmp)), server.url)
            stock.conf.broker_transport = kombu_redis.Transport
            best = {"ours": float("inf"), "kombu": float("inf")}
            for app in (ours, stock):  # warm-up: connections, the producer pool
                app.send_task(PREPROCESS_TASK, args=["job_warm"], queue=PREPROCESS_QUEUE)
            for _ in range(rounds):
                for name, app in (("kombu", stock), ("ours", ours)):
                    started = time.perf_counter()
                    for n in range(messages):
                        app.send_task(PREPROCESS_TASK, args=[f"job_{n}"], queue=PREPROCESS_QUEUE)
                    best[name] = min(best[name], (time.perf_counter() - started) / messages)
            assert type(stock.connection_for_write().default_channel) is kombu_redis.Channel
            chunks = chunk_messages(ours, rounds)
        finally:
            server.stop()
    return [
        {"name": "send_task per message, our transport / kombu's Redis transport", "value": round(
            best["ours"] / best["kombu"], 3), "goal": None},
        {"name": f"· per message: kombu's {best['kombu'] * 1e6:.0f} µs, ours {best['ours'] * 1e6:.0f} µs",
         "value": round((best["kombu"] - best["ours"]) * 1e6), "goal": None},
        {"name": f"a 2,000-line score file's {CHUNKS} chunk messages in one publish batch / one at a time",
         "value": round(chunks["batch"] / chunks["one by one"], 3), "goal": None},
        {"name": f"· per file: one at a time {chunks['one by one'] * 1e3:.1f} ms, in one batch "
                 f"{chunks['batch'] * 1e3:.1f} ms", "value": round((chunks["one by one"] - chunks["batch"]) * 1e3, 1),
         "goal": None},
    ]


def chunk_messages(app, rounds: int) -> dict[str, float]:
    """The API's chunk messages for a file (domain.batches.messages.send_chunks, a publish batch)
    against the same messages sent one at a time through one producer (the way before); best of
    ``rounds``, alternated."""
    best = {"one by one": float("inf"), "batch": float("inf")}
    for _ in range(rounds):
        started = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for index in range(CHUNKS):
                send_chunk(app, "batch_bench", index, producer=producer)
        best["one by one"] = min(best["one by one"], time.perf_counter() - started)
        started = time.perf_counter()
        send_chunks(app, "batch_bench", range(CHUNKS))
        best["batch"] = min(best["batch"], time.perf_counter() - started)
    return best


if __name__ == "__main__":
    print_rows(run())
