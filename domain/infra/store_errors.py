"""The store's failures in its own terms: what the API answers when Redis is away or full.

The stores call redis-py directly and let its errors rise (translating at every call would wrap
hundreds of them); the boundary is here instead. :func:`store_error` classifies whatever rose into
a typed :class:`StoreError` (a code, a Fault kind, a Retry-After), and :data:`STORE_FAILURES` is what
a caller catches to mean "the store failed": the layers above never name ``redis`` (an import
contract in pyproject.toml keeps web free of it).
"""

from __future__ import annotations

from typing import Protocol

import redis

from engine.errors import ServiceUnavailableError


class StoreError(ServiceUnavailableError):
    """The job store failed a request; the work may be retried (a 503 through the error map)."""


class StoreUnavailable(StoreError):
    """Redis could not be reached, timed out or failed over: retry shortly."""

    code = "redis_unavailable"

    def __init__(self, message: str = "the job store is unavailable; retry shortly", **kwargs):
        kwargs.setdefault("headers", {"Retry-After": "2"})
        super().__init__(message, **kwargs)


class StoreFull(StoreError):
    """Redis is at its high-water mark (or its bound): new work is refused until results expire
    or the bound is raised; work already accepted goes on (domain/infra/redis_memory.py)."""

    code = "redis_memory_full"


class MemoryRefusals(Protocol):
    """What tells a write refused for memory (domain.infra.redis_memory.MemoryGauge)."""

    def refusal_for(self, error: BaseException) -> StoreFull | None: ...


# What a caller catches for "the store failed": redis-py's errors as they rise from a store call,
# and ours once a reader translated them (domain.jobs.follow).
STORE_FAILURES: tuple[type[Exception], ...] = (redis.RedisError, StoreError)


def redis_cause(error: BaseException) -> redis.RedisError | None:
    """The Redis error behind ``error``: itself, or its cause (kombu wraps Redis' errors in its
    OperationalError when Celery cannot publish)."""
    for candidate in (error, error.__cause__):
        if isinstance(candidate, redis.RedisError):
            return candidate
    return None


def store_error(error: BaseException, memory: MemoryRefusals | None = None) -> StoreError | None:
    """The typed store error ``error`` stands for, or None when it is no store failure.

    A write Redis refused at its maxmemory is :class:`StoreFull` (told by ``memory``, which reads
    Redis' own numbers); every other Redis error is :class:`StoreUnavailable`."""
    if isinstance(error, StoreError):
        return error
    if redis_cause(error) is None:
        return None
    if memory is not None and (full := memory.refusal_for(error)) is not None:
        return full
    return StoreUnavailable()
