"""A dead GPU worker's messages go back to their queue at once, not after the visibility timeout.

kombu's Redis transport keeps a reserved message in its ``unacked`` hash until the worker
acknowledges it, and gives it back (``restore_visible``) only once it is older than
``ROLLOUT_VISIBILITY_TIMEOUT``: an hour by default, since it must exceed the longest job. A GPU
worker killed with a batch in flight left its jobs ``generating`` for up to that long while the
restarted worker sat idle.

So each GPU worker's heartbeat lists the delivery tags it holds (buffered, or in its running
session: :meth:`workers.tasks.gpu_batching.GenerateBatches.held_delivery_tags`), and this sweep (every
few seconds, in one worker at a time) restores each ``rollout.generate`` message of ``unacked``
that no live GPU worker lists, once every live one has beaten since the message was reserved
(plus a margin): a message a live worker has just taken is never restored under it, and a dead
worker's tags are freed when its heartbeat expires. The restore is kombu's own
``QoS.restore_by_tag`` (one transaction). A job whose message comes back is run again from its
prompt as a redelivery is, with the job store's exactly-once ending.

Written here because neither Celery nor kombu ties an unacknowledged message to the worker that
holds it.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import redis
from kombu.transport.redis import Channel

from workers.infra.heartbeats import HEARTBEAT_SECONDS, statuses
from workers.infra.lost_messages import start_sweeping
from workers.names import GENERATE_TASK

log = logging.getLogger(__name__)

# A live worker's beat lists a message at most one beat after it is reserved; twice that, and more.
MARGIN_S = 2 * HEARTBEAT_SECONDS + 1
SWEEP_EVERY_S = HEARTBEAT_SECONDS


def orphaned_generate_messages(client: redis.Redis, *, now: float | None = None) -> list[str]:
    """Delivery tags of ``rollout.generate`` messages held unacknowledged that no live GPU worker
    holds (and every live one has reported since they were reserved)."""
    now = time.time() if now is None else now
    beats = statuses(client, "gpu")
    held = {tag for beat in beats for tag in beat.get("held") or ()}
    reported_since = min((beat.get("at", now) for beat in beats), default=now) - MARGIN_S
    orphans = []
    for raw_tag, _ in client.zrangebyscore(Channel.unacked_index_key, "-inf", reported_since, withscores=True):
        tag = raw_tag.decode()
        if tag in held:
            continue
        raw = client.hget(Channel.unacked_key, tag)
        if raw is None:  # acknowledged meanwhile
            continue
        try:
            message = json.loads(raw)[0]  # [message, exchange, routing key]
        except (ValueError, IndexError, TypeError):
            continue
        if (message.get("headers") or {}).get("task") == GENERATE_TASK:
            orphans.append(tag)
    return orphans


class HeldMessageSweep:
    """``rt``: a worker's runtime (``redis``, ``celery``)."""

    def __init__(self, rt):
        self.rt = rt

    def sweep(self) -> list[str]:
        orphans = orphaned_generate_messages(self.rt.redis)
        if not orphans:
            return []
        with self.rt.celery.connection_for_write() as connection:
            qos = connection.default_channel.qos
            for tag in orphans:
                qos.restore_by_tag(tag)
        log.warning("%d generate messages no live GPU worker holds went back to their queues", len(orphans))
        return orphans


def start_held_message_sweep(rt) -> threading.Event:
    return start_sweeping(rt.redis, "held-messages", HeldMessageSweep(rt).sweep, every_s=SWEEP_EVERY_S)


__all__ = ["orphaned_generate_messages", "start_held_message_sweep"]
