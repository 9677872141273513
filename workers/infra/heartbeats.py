"""Worker heartbeats in Redis, so /healthz can tell which worker kinds are up.

Each worker process refreshes ``rq:worker:<kind>:<name>`` (a short TTL) from a daemon thread;
a worker that dies simply stops refreshing and its key expires.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import redis

WORKER_KINDS = ("cpu", "gpu", "webhooks", "batches")
HEARTBEAT_SECONDS = 2.0
HEARTBEAT_TTL = 10


def start_heartbeat(client: redis.Redis, kind: str, name: str, status: Callable[[], dict]) -> threading.Event:
    """Refresh this worker's heartbeat until the returned event is set."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                client.set(f"rq:worker:{kind}:{name}", json.dumps({"at": time.time(), **status()}), ex=HEARTBEAT_TTL)
            except redis.RedisError:
                pass  # Redis is down: the heartbeat resumes when it is back
            stop.wait(HEARTBEAT_SECONDS)

    threading.Thread(target=beat, name=f"heartbeat-{kind}", daemon=True).start()
    return stop


def alive_workers(client: redis.Redis) -> dict[str, dict]:
    """For each worker kind with a live heartbeat: the status of one of its workers (model ready first)."""
    alive: dict[str, dict] = {}
    for key in client.scan_iter(match="rq:worker:*", count=100):
        kind = key.decode().split(":")[2]
        raw = client.get(key)
        if raw is None:
            continue
        status = json.loads(raw)
        if kind not in alive or status.get("model_ready"):
            alive[kind] = status
    return alive


def statuses(client: redis.Redis, kind: str) -> list[dict]:
    """The status of every worker of ``kind`` with a live heartbeat."""
    out = []
    for key in client.scan_iter(match=f"rq:worker:{kind}:*", count=100):
        raw = client.get(key)
        if raw is not None:
            out.append(json.loads(raw))
    return out


def vanished(client: redis.Redis, kinds: tuple[str, ...], seen_key: str) -> set[str]:
    """The heartbeats of ``kinds`` live at the previous call (by any process, remembered in
    ``seen_key``) and gone now: workers that died or stopped in between."""
    live = {key for kind in kinds for key in client.scan_iter(match=f"rq:worker:{kind}:*", count=100)}
    pipe = client.pipeline()
    pipe.smembers(seen_key)
    pipe.delete(seen_key)
    if live:
        pipe.sadd(seen_key, *live)
    before = pipe.execute()[0]
    return {key.decode() for key in before - live}


def any_alive(client: redis.Redis, kind: str) -> bool:
    """Whether some worker of ``kind`` has a live heartbeat."""
    return next(client.scan_iter(match=f"rq:worker:{kind}:*", count=100), None) is not None
