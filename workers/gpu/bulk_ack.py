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

log = logging.getLogger(__name__)


def acknowledge_messages(messages: Iterable[Message]) -> None:
    """Acknowledge every message not acknowledged yet. When Redis is away the messages stay
    unacknowledged (logged, as kombu's ``ack_log_error`` does): they come back after the
    visibility timeout, and their jobs, ended, settle them then."""
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
        with qos.pipe_or_acquire() as pipe:
            for message in messages:
                qos._remove_from_indices(message.delivery_tag, pipe)
            pipe.execute()
    except redis.RedisError as error:
        log.warning("could not acknowledge %d messages: %s", len(messages), error)
        return
    for message in messages:
        virtual.QoS.ack(qos, message.delivery_tag)
        message._state = "ACK"
