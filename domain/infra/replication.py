"""A 202 that means durable: wait until replicas hold what a request wrote (Redis ``WAIT``).

Redis replicates asynchronously, so a primary that dies right after answering can take the last
writes with it; a failover then promotes a replica without them. With ``ROLLOUT_REDIS_REPLICA_ACKS``
the API confirms each created job and batch with ``WAIT`` before it answers (README "Running Redis
for production").
"""

from __future__ import annotations

import redis

from engine.errors import ServiceUnavailableError


class NotDurableError(ServiceUnavailableError):
    """The record was created on the primary, but fewer replicas than asked confirmed it in time: a
    failover now could lose it. It may still run; its id is in ``errors``."""

    code = "not_durable"


# A key each confirmation overwrites: a write of this connection after everything the request wrote
# (Celery's message went through another connection), so WAIT, which counts the replicas holding
# this connection's last write, covers all of it.
MARK_KEY = "rq:replication:mark"


def confirm_replicated(client: redis.Redis, record_id: str, replicas: int, timeout_ms: int) -> None:
    """Return once ``replicas`` replicas hold every write made before this call;
    :class:`NotDurableError` if they do not within ``timeout_ms``."""
    pipe = client.pipeline(transaction=False)
    pipe.set(MARK_KEY, record_id, px=60_000)
    pipe.execute_command("WAIT", replicas, timeout_ms)
    acknowledged = pipe.execute()[1]
    if acknowledged < replicas:
        raise NotDurableError(
            f"{record_id} was created, but {acknowledged} of the {replicas} replicas asked for confirmed it within "
            f"{timeout_ms} ms; it may still run (read it by id) or be lost if the primary fails now",
            errors={"id": record_id, "replicas_acknowledged": acknowledged, "replicas_wanted": replicas})


def confirm_if_asked(rt, record_id: str) -> None:
    """:func:`confirm_replicated` with the settings of ``rt`` (the API's services or a runtime)."""
    if rt.settings.redis_replica_acks:
        confirm_replicated(rt.redis, record_id, rt.settings.redis_replica_acks, rt.settings.redis_replica_timeout_ms)
