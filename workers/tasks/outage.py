"""What a task does when Redis goes away under it, or refuses a write for memory: its message goes
back to the queue.

Celery acknowledges the message of a task that raised, and that ack (retried by the broker client)
lands once Redis is back: the work (a job, a webhook delivery) would be lost for good. Rejecting
with requeue puts the message back instead (or, while Redis is still away, leaves it
unacknowledged for kombu to restore; at its maxmemory, where Redis refuses to put it back, the
held-message sweep restores it once Redis has room, ``workers/celery_transport.py``); every task
is idempotent, so running it again is safe.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from celery.exceptions import Reject

from domain.infra.redis_client import REDIS_DOWN
from workers.memory_refusal import refused_for_memory

log = logging.getLogger(__name__)


@contextmanager
def requeued_while_redis_is_down(what: str, client: redis.Redis | None = None) -> Iterator[None]:
    """Run a task's body; on a Redis outage or a write refused for memory (``client``: where to tell
    a script's refusal, ``workers/memory_refusal.py``), log ``what`` was interrupted and requeue the
    message."""
    try:
        yield
    except REDIS_DOWN as exc:
        log.warning("Redis unavailable during %s; message requeued (%s)", what, exc.__class__.__name__)
        raise Reject(exc, requeue=True) from exc
    except Exception as exc:
        if not refused_for_memory(client, exc):
            raise
        log.warning("Redis at its maxmemory during %s; message requeued", what)
        raise Reject(exc, requeue=True) from exc
