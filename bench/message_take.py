"""Taking a burst of waiting messages: kombu's Redis transport beside ours (workers/celery_transport.py).

A burst of small Celery-shaped messages waits in one queue of an embedded Redis (what a batch
chunk, a GRPO step or a restarted GPU worker finds); one kombu consumer with a prefetch window
of 32 (the GPU worker's: two batches of 16) takes and acknowledges them all, with kombu's own
transport and with ours, alternated, in one run. Reported per message: the consumer's CPU time,
Redis' CPU time and the commands Redis ran (``INFO commandstats``; a script's inner calls count
there too, so the round trips are BRPOP + EVALSHA + ...). The figures are the medians of the rounds.

Run: ``python -m bench.message_take`` from the repository root (about 20 s).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from bench.rows import print_rows
from domain.infra.redis_server import EmbeddedRedis
from workers import celery_transport

QUEUE = Queue("bench-take", Exchange("bench-take"), routing_key="bench-take")
PREFETCH = 32
ROUND_TRIPS = ("cmdstat_brpop", "cmdstat_evalsha", "cmdstat_eval", "cmdstat_exec", "cmdstat_zrem", "cmdstat_hdel")


def publish(url: str, count: int) -> None:
    body = {"job_id": "job_" + "x" * 22, "task": "rollout.generate"}
    with Connection(url) as connection:
        producer = Producer(connection.default_channel, exchange=QUEUE.exchange, routing_key=QUEUE.routing_key)
        QUEUE(connection.default_channel).declare()
        for _ in range(count):
            producer.publish(body, declare=[QUEUE])


def take_all(url: str, transport, count: int) -> float:
    """CPU seconds of this process to take and acknowledge ``count`` waiting messages."""
    taken = 0

    def on_message(body, message):
        nonlocal taken
        taken += 1
        message.ack()

    with Connection(url, transport=transport) as connection:
        consumer = Consumer(connection.default_channel, [QUEUE], callbacks=[on_message], accept=["json"])
        consumer.qos(prefetch_count=PREFETCH)
        with consumer:
            started = time.process_time()
            while taken < count:
                connection.drain_events(timeout=5)
            return time.process_time() - started


def redis_state(client: redis.Redis) -> tuple[float, dict[str, int]]:
    cpu = client.info("cpu")
    calls = {name: stats["calls"] for name, stats in client.info("commandstats").items()}
    return cpu["used_cpu_sys"] + cpu["used_cpu_user"], calls


def run(messages: int = 2000, rounds: int = 5) -> list[dict]:
    results: dict[str, dict[str, list[float]]] = {"kombu": {}, "ours": {}}
    with tempfile.TemporaryDirectory(prefix="rq-bench-take-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", persistent=False).start()
        client = redis.Redis.from_url(server.url)
        try:
            for _ in range(rounds):
                for name, transport in (("kombu", "redis"), ("ours", celery_transport.Transport)):
                    publish(server.url, messages)
                    redis_cpu, calls = redis_state(client)
                    consumer_cpu = take_all(server.url, transport, messages)
                    redis_after, calls_after = redis_state(client)
                    trips = sum(calls_after.get(k, 0) - calls.get(k, 0) for k in ("cmdstat_brpop", "cmdstat_evalsha",
                                                                                 "cmdstat_eval", "cmdstat_exec"))
                    figures = results[name]
                    figures.setdefault("consumer", []).append(consumer_cpu / messages * 1e6)
                    figures.setdefault("redis", []).append((redis_after - redis_cpu) / messages * 1e6)
                    figures.setdefault("trips", []).append(trips / messages)
        finally:
            client.close()
            server.stop()
    median = {name: {k: statistics.median(v) for k, v in figures.items()} for name, figures in results.items()}
    kombu, ours = median["kombu"], median["ours"]
    rows = [_row(f"taking a burst of {messages} messages, prefetch {PREFETCH}: consumer CPU per message, "
                 "kombu's transport / ours (median of {rounds})".replace("{rounds}", str(rounds)),
                 kombu["consumer"] / ours["consumer"])]
    for name in ("kombu", "ours"):
        figures = median[name]
        label = "kombu's Redis transport" if name == "kombu" else "workers/celery_transport.py"
        rows += [_row(f"· {label}: consumer CPU per message taken and acked (us)", figures["consumer"]),
                 _row(f"· {label}: Redis CPU per message (us)", figures["redis"]),
                 _row(f"· {label}: BRPOP, scripts and transactions per message", figures["trips"])]
    return rows


def _row(name: str, value: float, goal: str | None = None) -> dict:
    return {"name": name, "value": round(value, 3), "goal": goal}


if __name__ == "__main__":
    print_rows(run())
