"""A dead worker's messages go back to their queue at once, not after the visibility timeout.

kombu's Redis transport keeps a reserved message in its ``unacked`` hash until the worker
acknowledges it, and gives it back (``restore_visible``) only once it is older than
``ROLLOUT_VISIBILITY_TIMEOUT``: an hour by default, since it must exceed the longest job. A GPU
worker killed with a batch in flight left its jobs ``generating`` for up to that long while the
restarted worker sat idle; a webhooks worker killed (or cut off from Redis) holding a job's end
left its webhook an hour late.

So the heartbeat of every worker lists the delivery tags it holds: what its Celery consumer holds
(:func:`celery_held_tags`; a prefork worker's main process tracks what its pool processes run) and,
on a GPU worker, the generate messages celery-batches buffers or its running session holds
(:meth:`workers.tasks.gpu_batching.GenerateBatches.held_delivery_tags`). A sweep per kind (every few
seconds, in one worker at a time; the kinds' tasks: ``WorkerKind.tasks_held``, workers/worker_kinds.py) restores
each message of the kind's tasks in ``unacked`` that no
live worker of the kind lists, once every live one has beaten since the message was reserved (plus
a margin): a message a live worker has just taken is never restored under it, and a dead worker's
tags are freed when its heartbeat expires. The restore is kombu's own ``QoS.restore_by_tag`` (one
transaction). What runs again is idempotent: a job from its prompt as a redelivery is (the job
store ends it once), a webhook attempt under its own claim and ``webhook-id``.

Written here because neither Celery nor kombu ties an unacknowledged message to the worker that
holds it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Collection

import redis
from celery.worker import state
from celery.worker.request import Request
from kombu.transport.redis import Channel

from domain.infra.heartbeats import HEARTBEAT_SECONDS, statuses
from domain.infra.lost_messages import start_sweeping

log = logging.getLogger(__name__)


def margin_for(heartbeat_s: float) -> float:
    """A live worker's beat lists a message at most one beat after it is reserved; twice that, and more."""
    return 2 * heartbeat_s + 1


MARGIN_S = margin_for(HEARTBEAT_SECONDS)


def celery_held_tags(consumer) -> list[str]:
    """The delivery tags of the messages a Celery worker holds unacknowledged: reserved or running
    (``celery.worker.state``), or waiting in the consumer's timer for their ETA (a countdown retry,
    which Celery keeps out of ``reserved_requests`` until it is due). Read from the heartbeat thread,
    so each collection is copied in one step (a C-level copy, atomic under the GIL) before use."""
    requests = [ref() for ref in (*tuple(state.reserved_requests.data), *tuple(state.active_requests.data))]
    for event in consumer.timer.queue:  # a snapshot of the timer's heap
        if not event.entry.canceled:
            requests.extend(arg for arg in event.entry.args if isinstance(arg, Request))
    return sorted({str(request.message.delivery_tag) for request in requests
                   if request is not None and request.message is not None and not request.message.acknowledged})


def orphaned_messages(client: redis.Redis, kind: str, tasks: Collection[str], *,
                      now: float | None = None, margin_s: float = MARGIN_S) -> list[str]:
    """Delivery tags of messages of ``tasks`` held unacknowledged that no live worker of ``kind``
    holds (and every live one has reported since they were reserved)."""
    now = time.time() if now is None else now
    beats = statuses(client, kind)
    held = {tag for beat in beats for tag in beat.get("held") or ()}
    reported_since = min((beat.get("at", now) for beat in beats), default=now) - margin_s
    candidates = [tag for tag in (raw.decode() for raw in client.zrangebyscore(
        Channel.unacked_index_key, "-inf", reported_since)) if tag not in held]
    if not candidates:
        return []
    orphans = []
    # One HMGET: every other kind's held messages are candidates too, until their task is read.
    for tag, raw in zip(candidates, client.hmget(Channel.unacked_key, candidates), strict=True):
        if raw is None:  # acknowledged meanwhile
            continue
        try:
            message = json.loads(raw)[0]  # [message, exchange, routing key]
        except (ValueError, IndexError, TypeError):
            continue
        if (message.get("headers") or {}).get("task") in tasks:
            orphans.append(tag)
    return orphans


class HeldMessageSweep:
    """``rt``: a worker's runtime (``redis``, ``celery``); ``kind``: whose workers hold ``tasks``."""

    def __init__(self, rt, kind: str, tasks: Collection[str]):
        self.rt, self.kind, self.tasks = rt, kind, frozenset(tasks)
        self.margin_s = margin_for(rt.settings.heartbeat_seconds)

    def sweep(self) -> list[str]:
        orphans = orphaned_messages(self.rt.redis, self.kind, self.tasks, margin_s=self.margin_s)
        if not orphans:
            return []
        with self.rt.celery.connection_for_write() as connection:
            qos = connection.default_channel.qos
            for tag in orphans:
                qos.restore_by_tag(tag)
        log.warning("%d %s messages no live %s worker holds went back to their queues", len(orphans),
                    "/".join(sorted(self.tasks)), self.kind)
        return orphans


def start_held_message_sweep(rt, kind: str, tasks: Collection[str]) -> threading.Event:
    return start_sweeping(rt.redis, f"held-messages-{kind}", HeldMessageSweep(rt, kind, tasks).sweep,
                          every_s=rt.settings.heartbeat_seconds)


__all__ = ["celery_held_tags", "orphaned_messages", "start_held_message_sweep"]
