"""Finding work whose Celery message a crash lost: what the sweeps of ``domain/jobs/reaper.py``
(unfinished jobs), ``domain/webhooks/reaper.py`` (owed webhooks) and ``domain/batches/reaper.py``
(a batch's chunks and expiry) share.

Work in flight is carried by a message: in a queue, held unacknowledged by a worker (kombu's
``unacked`` hash: reserved, running, or waiting for its countdown), or parked or being woken by a
fair share (``domain/infra/fair_share.py``). kombu's Redis transport pops a message (BRPOP) before it
records it as unacknowledged, so a worker or Redis killed in between loses it, and nothing would
ever run that work again. A sweep looks for the ids of stalled work in every carrier; an id found
in none in two sweeps running, a sweep apart (the gap lasts milliseconds), is lost, and its message
is sent again. Every task is idempotent, so a duplicate that slips through costs a no-op.

Written here because neither Celery nor kombu reconciles what an application expects to run with
what the broker holds.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import threading
from collections.abc import Callable, Collection, Iterable

import redis
from kombu.transport.redis import Channel

from domain.infra.intake_order import all_lists

log = logging.getLogger(__name__)

_PAGE = 1000  # queue entries read per round trip


def sweep_every(stall_s: float) -> float:
    """Seconds between sweeps: a few per stall period, at least one second and at most a minute."""
    return min(max(stall_s / 10, 1.0), 60.0)


def ids_in_messages(client: redis.Redis, pattern: re.Pattern[bytes], *, queues: Iterable[str],
                    parked: Iterable[bytes] = ()) -> set[str]:
    """The ids matching ``pattern`` that some message names now: ``parked`` (a fair share's raw
    entries), then the ``queues`` (every priority list of each), then kombu's unacknowledged
    messages. Read in the order messages flow, so one that moves on during the read is seen where
    it arrives."""
    found: set[bytes] = set()
    for entry in parked:
        found.update(pattern.findall(entry))
    for queue in all_lists(queues):
        start = 0
        while page := client.lrange(queue, start, start + _PAGE - 1):
            for message in page:
                found.update(pattern.findall(message))
            start += _PAGE
    for _, message in client.hscan_iter(Channel.unacked_key, count=_PAGE):
        found.update(pattern.findall(message))
    return {found_id.decode() for found_id in found}


def task_calls_in_messages(client: redis.Redis, tasks: Collection[str], *, queues: Iterable[str]) -> set[tuple]:
    """``(task, *args)`` of every message of ``tasks`` in the ``queues`` (all their lists) or held unacknowledged:
    for work named by more than one id (a batch's chunk), where a pattern over the raw message
    cannot tell which task it belongs to. Only messages naming one of ``tasks`` are parsed."""
    names = tuple(task.encode() for task in tasks)
    found: set[tuple] = set()

    def take(message: dict) -> None:
        headers = message.get("headers") or {}
        if headers.get("task") in tasks:
            # Celery's protocol 2 puts a repr of the args in the headers (the body is base64).
            try:
                found.add((headers["task"], *ast.literal_eval(headers.get("argsrepr") or "()")))
            except (ValueError, SyntaxError):
                pass  # not ours to read: at worst its work is sent once more, a no-op

    for queue in all_lists(queues):
        start = 0
        while page := client.lrange(queue, start, start + _PAGE - 1):
            for raw in page:
                if any(name in raw for name in names):
                    take(json.loads(raw))
            start += _PAGE
    for _, raw in client.hscan_iter(Channel.unacked_key, count=_PAGE):
        if any(name in raw for name in names):
            take(json.loads(raw)[0])  # [message, exchange, routing key]
    return found


class Suspects:
    """Ids a sweep found no message for, kept until the next sweep (a Redis set, so any worker's
    sweep may be the next)."""

    def __init__(self, client: redis.Redis, key: str, *, ttl: int):
        self.redis = client
        self.key = key
        self.ttl = ttl

    def confirm(self, missing: list[str]) -> list[str]:
        """The ids of ``missing`` the last sweep missed too (lost); the rest become the suspects."""
        before = {member.decode() for member in self.redis.smembers(self.key)}
        lost = [item for item in missing if item in before]
        pipe = self.redis.pipeline()
        pipe.delete(self.key)
        if suspected := [item for item in missing if item not in before]:
            pipe.sadd(self.key, *suspected)
            pipe.expire(self.key, self.ttl)
        pipe.execute()
        return lost

    def clear(self) -> None:
        self.redis.delete(self.key)


def start_sweeping(client: redis.Redis, name: str, sweep: Callable[[], object], *, every_s: float) -> threading.Event:
    """Run ``sweep`` in a daemon thread, at most once per ``every_s`` across all workers (whoever
    takes the lock sweeps; it lapses by itself, so sweeps stay an interval apart), until the
    returned event is set."""
    stop, lock_key = threading.Event(), f"rq:sweep:{name}:lock"

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                if client.set(lock_key, 1, nx=True, px=int(every_s * 1000)):
                    sweep()
            except redis.RedisError:
                pass  # Redis is away: the next sweep tries again
            except Exception:
                log.exception("sweep %s failed", name)

    threading.Thread(target=loop, name=f"sweep-{name}", daemon=True).start()
    return stop
