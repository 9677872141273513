"""The feature transport's acknowledgements through Redis: the engine's ``AckChannel``.

A consumer done with features pushes their ids onto the pool's list ``rq:transport:acks:<pool>``
(one pipeline for every pool of a batch); the producer's pool pops its list on every wrap and in
``reap()`` and frees the regions (``engine/transport/pool.py``). A lost ack only delays reuse
until the pool's ``ack_timeout`` reclaims the region, so an outage is logged and reported
(False, None), never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import redis

log = logging.getLogger(__name__)

ACK_KEY_PREFIX = "rq:transport:acks:"
# An ack list outlives its pool only if the producer died; expire it instead of leaking keys.
ACK_KEY_TTL_S = 3600
# Ids popped per round trip while draining (LPOP with a count).
DRAIN_BATCH = 1024


def ack_key(pool_id: str) -> str:
    return f"{ACK_KEY_PREFIX}{pool_id}"


class RedisAckChannel:
    """``engine.transport.AckChannel`` on Redis lists, one per producer pool."""

    def __init__(self, client: redis.Redis):
        self.client = client

    def send(self, acks: Mapping[str, Sequence[str]]) -> bool:
        acks = {pool_id: ids for pool_id, ids in acks.items() if ids}
        if not acks:
            return True
        try:
            pipe = self.client.pipeline(transaction=False)
            for pool_id, ids in acks.items():
                pipe.rpush(ack_key(pool_id), *ids)
                pipe.expire(ack_key(pool_id), ACK_KEY_TTL_S)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not push acks for pool(s) %s", ", ".join(acks), exc_info=True)
            return False
        return True

    def drain(self, pool_id: str) -> list[str] | None:
        ids: list[str] = []
        try:
            while True:
                batch = self.client.lpop(ack_key(pool_id), DRAIN_BATCH)
                if not batch:
                    break
                ids.extend(b.decode() if isinstance(b, bytes) else b for b in batch)
                if len(batch) < DRAIN_BATCH:
                    break
        except redis.RedisError:
            log.warning("could not drain acks of pool %s", pool_id, exc_info=True)
            return None
        return ids

    def discard(self, pool_id: str) -> None:
        try:
            self.client.delete(ack_key(pool_id))
        except redis.RedisError:
            log.warning("could not delete the ack list of pool %s", pool_id, exc_info=True)
