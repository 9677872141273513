"""Whether an error is Redis refusing a write for memory (``noeviction`` at its ``maxmemory``).

A worker's writes finish work already accepted; one Redis refuses for memory is no fault of the
job, so the worker puts the work back or holds it and writes again once results expire, never
fails it (README, "Sizing Redis memory"). Told as ``domain/infra/redis_memory.py`` tells the API's
refusals: redis-py types a command's OOM reply (``OutOfMemoryError``); a script's refused write
comes back as a plain ``ResponseError`` (Redis 6 wraps the reply), told by Redis' memory read now.
Here the mark is the high-water one, not the bound itself: memory read a moment after a refusal may
already be a little below the bound, and failing an accepted job on that would lose it.
"""

from __future__ import annotations

import redis

from domain.infra.redis_memory import read_memory


def refused_for_memory(client: redis.Redis | None, error: BaseException) -> bool:
    """``client``: where to read Redis' memory for a script's refusal (None: typed refusals only)."""
    cause = error if isinstance(error, redis.RedisError) else error.__cause__  # kombu wraps Redis' errors
    if isinstance(cause, redis.exceptions.OutOfMemoryError):
        return True
    if type(cause) is not redis.ResponseError or client is None:
        return False
    try:
        return read_memory(client).above_high_water
    except redis.RedisError:
        return False
