"""Acknowledge many of the GPU worker's messages in one round trip.

kombu's Redis transport settles each message on its own (``QoS.ack``: a MULTI/EXEC that removes it
from the unacknowledged index and hash), so a decode step that ended 16 jobs paid 16 round trips.
kombu has no bulk acknowledgement, so this is written by hand: one pipeline removes every message
of a channel from both, then each message is marked acknowledged as ``Message.ack`` marks it
(the virtual QoS forgets it, which frees its place in the prefetch window). It reaches into
``QoS._remove_from_indices``, the step ``QoS.ack`` itself runs; ``tests/workers/gpu/test_bulk_ack.py``
pins what it relies on. Messages of another transport are acknowledged one by one. Run it where
Celery runs its own acks: on the consumer's event loop (``workers/tasks/gpu_batching.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import redis
from kombu.message import Message
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from workers.celery_transport import removal_pipeline

log = logging.getLogger(__name__)


def acknowledge_messages(messages: Iterable[Message]) -> None:
    """Acknowledge every message not acknowledged yet. Redis at its maxmemory runs the removal (not
    a MULTI, ``workers/celery_transport.py``). When Redis is away the messages stay in ``unacked``
    (logged, as kombu's ``ack_log_error`` does) but leave the prefetch window all the same, or a
    window of such messages would stop the worker for good: no live worker lists them, so the
    held-message sweep gives them back and their jobs, ended, settle them then."""
    by_channel: dict[int, list[Message]] = {}
    for message in messages:
        if message.acknowledged:
            continue
        if isinstance(getattr(message.channel, "qos", None), kombu_redis.QoS):
            by_channel.setdefault(id(message.channel), []).append(message)
        else:
            message.ack_log_error(log, (Exception,))
    for batch in by_channel.values():
        _acknowledge_on_one_channel(batch)


def _acknowledge_on_one_channel(messages: list[Message]) -> None:
    qos = messages[0].channel.qos
    try:
        pipe = removal_pipeline(qos)  # not a MULTI: Redis at its maxmemory runs it (celery_transport.py)
        for message in messages:
            qos._remove_from_indices(message.delivery_tag, pipe)
        pipe.execute()
    except redis.RedisError as error:
        log.warning("could not acknowledge %d messages (the held-message sweep gives them back): %s",
                    len(messages), error)
    for message in messages:
        virtual.QoS.ack(qos, message.delivery_tag)
        message._state = "ACK"
