"""Worker heartbeats in Redis, so /healthz can tell which worker kinds are up.

Each worker process refreshes ``rq:worker:<kind>:<name>`` (a short TTL) from a daemon thread;
a worker that dies simply stops refreshing and its key expires. Beside its key, each beat writes
the worker's name into its kind's index, ``rq:workers:<kind>`` (a sorted set scored by the time of
the last beat), so readers list a kind's workers with one ZRANGE and one MGET instead of scanning
the whole keyspace (thousands of round trips with many jobs' keys). The key is the truth about
liveness; the index only says where to look, and readers drop entries that have not beaten for
``INDEX_KEEP_S`` (far beyond the TTL, so clocks that disagree by minutes lose nothing).

A worker beats every ``ROLLOUT_HEARTBEAT_SECONDS`` (2 s) and its key lives ``TTL_BEATS`` beats.
A worker that was paused past its TTL (a GC pause, swap, a frozen VM) says so in its log when it
beats again: its messages may have run elsewhere meanwhile, and its late writes are fenced
(domain/jobs/attempts.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import redis

WORKER_KINDS = ("cpu", "gpu", "webhooks", "batches")
log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0
TTL_BEATS = 5  # a key outlives four missed beats
HEARTBEAT_TTL = HEARTBEAT_SECONDS * TTL_BEATS
INDEX_KEEP_S = 600


def heartbeat_key(kind: str, name: str) -> str:
    return f"rq:worker:{kind}:{name}"


def _index_key(kind: str) -> str:
    return f"rq:workers:{kind}"


def beat(client: redis.Redis, kind: str, name: str, status: dict, *, ttl: float = HEARTBEAT_TTL) -> None:
    """One heartbeat: the worker's status under its key (with the TTL) and its name in the index."""
    now = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.set(heartbeat_key(kind, name), json.dumps({"at": now, **status}), px=int(ttl * 1000))
    pipe.zadd(_index_key(kind), {name: now})
    pipe.execute()


def start_heartbeat(client: redis.Redis, kind: str, name: str, status: Callable[[], dict], *,
                    every_s: float = HEARTBEAT_SECONDS) -> threading.Event:
    """Refresh this worker's heartbeat every ``every_s`` until the returned event is set."""
    stop = threading.Event()
    ttl = every_s * TTL_BEATS

    def loop() -> None:
        last = time.monotonic()
        while not stop.is_set():
            try:
                beat(client, kind, name, status(), ttl=ttl)
                now = time.monotonic()
                if now - last > ttl:
                    log.warning("this %s worker's heartbeat lapsed for %.1f s (paused?): what it held may have "
                                "run elsewhere meanwhile", kind, now - last)
                last = now
            except redis.RedisError:
                pass  # Redis is down: the heartbeat resumes when it is back
            stop.wait(every_s)

    threading.Thread(target=loop, name=f"heartbeat-{kind}", daemon=True).start()
    return stop


def live(client: redis.Redis, kinds: tuple[str, ...]) -> dict[str, dict]:
    """``{heartbeat key: status}`` of every worker of ``kinds`` whose heartbeat has not lapsed."""
    pipe = client.pipeline(transaction=False)
    for kind in kinds:
        pipe.zremrangebyscore(_index_key(kind), "-inf", time.time() - INDEX_KEEP_S)
        pipe.zrange(_index_key(kind), 0, -1)
    replies = pipe.execute()
    keys = [heartbeat_key(kind, name.decode()) for kind, names in zip(kinds, replies[1::2], strict=True)
            for name in names]
    if not keys:
        return {}
    return {key: json.loads(raw) for key, raw in zip(keys, client.mget(keys), strict=True) if raw is not None}


def indexed(client: redis.Redis, kind: str) -> set[str]:
    """The workers of ``kind`` that beat within ``INDEX_KEEP_S`` (live or not): what may still hold
    messages that the held-message sweep has yet to give back."""
    return {name.decode() for name in client.zrangebyscore(_index_key(kind), time.time() - INDEX_KEEP_S, "+inf")}


def alive_workers(client: redis.Redis, beats: dict[str, dict] | None = None) -> dict[str, dict]:
    """For each worker kind with a live heartbeat: the status of one of its workers (model ready
    first). ``beats``: :func:`live`'s of every kind, when read already."""
    alive: dict[str, dict] = {}
    for key, status in (live(client, WORKER_KINDS) if beats is None else beats).items():
        kind = key.split(":")[2]
        if kind not in alive or status.get("model_ready"):
            alive[kind] = status
    return alive


def statuses(client: redis.Redis, kind: str) -> list[dict]:
    """The status of every worker of ``kind`` with a live heartbeat."""
    return list(live(client, (kind,)).values())


def vanished(client: redis.Redis, kinds: tuple[str, ...], seen_key: str) -> set[str]:
    """The heartbeats of ``kinds`` live at the previous call (by any process, remembered in
    ``seen_key``) and gone now: workers that died or stopped in between."""
    now = set(live(client, kinds))
    pipe = client.pipeline()
    pipe.smembers(seen_key)
    pipe.delete(seen_key)
    if now:
        pipe.sadd(seen_key, *now)
    before = pipe.execute()[0]
    return {key.decode() for key in before} - now


def stalled(beats: dict[str, dict], after_s: float, *, now: float | None = None) -> dict[str, dict]:
    """Of ``beats`` (:func:`live`'s), the workers that hold messages and have not made progress
    (their beat's ``progress_at``, a GPU worker's: workers/gpu/progress.py) for ``after_s``
    seconds, by name: how many messages each holds and for how long it has not moved."""
    now = time.time() if now is None else now
    out = {}
    for key, status in beats.items():
        since = status.get("progress_at")
        if since is not None and status.get("held") and now - since > after_s:
            out[key.split(":", 3)[3]] = {"held": len(status["held"]), "idle_seconds": round(now - since, 1)}
    return out


def any_alive(client: redis.Redis, kind: str) -> bool:
    """Whether some worker of ``kind`` has a live heartbeat."""
    return bool(live(client, (kind,)))
