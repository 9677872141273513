"""Redis' memory against its bound: what the API admits new work by, and what ``/healthz`` and
``/metrics`` show.

Redis runs with ``maxmemory-policy noeviction`` (domain/infra/redis_server.py): at its
``maxmemory`` it refuses every write with an OOM error rather than drop a job, a message or a
result. That refusal would reach the workers too, whose writes finish work already accepted (a
job's tokens, its end, its webhook), so the API stops taking new work earlier, at a high-water
mark below the bound: what is accepted can still finish in the room left (README, "Sizing Redis
memory").
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from domain.infra.store_errors import StoreFull, redis_cause

# The sum of the reservations of domain/infra/redis_reservations.py (which imports this module).
RESERVED_TOTAL_KEY = "rq:reserve:total"
# The share of maxmemory at which the API refuses new work; the rest is for the work accepted.
HIGH_WATER = 0.9
# Each process reads INFO at most this often: a submit path never pays a round trip per request.
READ_EVERY_SECONDS = 1.0
# The embedded Redis' bound without ROLLOUT_REDIS_MAXMEMORY_BYTES: this share of the machine's
# memory (or of the container's limit), leaving the rest to the model, the workers and the page cache.
DEFAULT_SHARE = 0.25


@dataclass(frozen=True)
class MemoryUse:
    used_bytes: int
    maxmemory_bytes: int  # 0: Redis has no bound
    high_water: float = HIGH_WATER
    # What accepted jobs may still write (domain/infra/redis_reservations.py); counted at submit.
    reserved_bytes: int = 0

    @property
    def bounded(self) -> bool:
        return self.maxmemory_bytes > 0

    @property
    def high_water_bytes(self) -> int | None:
        return int(self.maxmemory_bytes * self.high_water) if self.bounded else None

    @property
    def above_high_water(self) -> bool:
        return self.bounded and self.used_bytes >= self.maxmemory_bytes * self.high_water

    @property
    def full(self) -> bool:
        return self.bounded and self.used_bytes >= self.maxmemory_bytes

    def refusal(self, asked_bytes: int = 0) -> StoreFull:
        """``asked_bytes``: what the refused work would have reserved (its results' bound)."""
        reserved = (f", {self.reserved_bytes} more are reserved for accepted jobs' results and this work "
                    f"asks {asked_bytes}" if asked_bytes else "")
        return StoreFull(
            f"Redis holds {self.used_bytes} bytes of its {self.maxmemory_bytes}-byte maxmemory{reserved} (new work "
            f"stops at {self.high_water:.0%}): retry once results expire, or raise the bound",
            errors={"used_bytes": self.used_bytes, "maxmemory_bytes": self.maxmemory_bytes,
                    **({"reserved_bytes": self.reserved_bytes, "asked_bytes": asked_bytes} if asked_bytes else {})},
            headers={"Retry-After": "60"})


def read_memory(client: redis.Redis, high_water: float = HIGH_WATER) -> MemoryUse:
    """One ``INFO memory``: it carries ``maxmemory`` too, so no ``CONFIG GET`` (which managed Redis
    services often disable) is needed, on our embedded Redis or on anyone's."""
    pipe = client.pipeline(transaction=False)
    pipe.info("memory")
    pipe.get(RESERVED_TOTAL_KEY)
    info, reserved = pipe.execute()
    return MemoryUse(int(info["used_memory"]), int(info.get("maxmemory", 0)), high_water, int(reserved or 0))


class MemoryGauge:
    """:func:`read_memory` at most once per ``every`` seconds per process, shared by its threads."""

    def __init__(self, client: redis.Redis, *, high_water: float = HIGH_WATER, every: float = READ_EVERY_SECONDS,
                 clock=time.monotonic):
        self.client, self.high_water, self.every, self.clock = client, high_water, every, clock
        self._lock = threading.Lock()
        self._last: tuple[float, MemoryUse] | None = None

    def read(self, *, fresh: bool = False) -> MemoryUse:
        with self._lock:
            now = self.clock()
            if fresh or self._last is None or now - self._last[0] >= self.every:
                self._last = (now, read_memory(self.client, self.high_water))
            return self._last[1]

    def admit(self) -> None:
        """Raise :class:`StoreFull` while Redis is at its high-water mark; an unbounded
        Redis (``maxmemory`` 0) admits everything."""
        use = self.read()
        if use.above_high_water:
            raise use.refusal()

    def refusal_for(self, error: BaseException) -> StoreFull | None:
        """The typed refusal when ``error`` is Redis refusing a write for memory, else None. redis-py
        types a command's OOM reply (``OutOfMemoryError``); a script's write refused for memory
        comes back as a plain ``ResponseError`` (Redis 6 wraps the reply), so that one is told by
        Redis' own memory, read now: the server answered, so it is up."""
        cause = redis_cause(error)  # kombu wraps Redis' errors
        if not isinstance(cause, redis.ResponseError):
            return None
        try:
            use = self.read(fresh=True)
        except redis.RedisError:
            use = None
        if isinstance(cause, redis.exceptions.OutOfMemoryError):  # the refusal, with its numbers if they read
            return (use or MemoryUse(0, 0, self.high_water)).refusal()
        return use.refusal() if use is not None and use.full else None


def machine_memory_bytes() -> int:
    """The memory this process may use: the machine's RAM, or its container's (cgroup) limit when lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit_bytes()
    return min(physical, limit) if limit else physical


def default_maxmemory_bytes(machine_bytes: int | None = None) -> int:
    """The embedded Redis' ``maxmemory`` when none is set: a quarter of ``machine_bytes`` (the
    machine's memory, :func:`machine_memory_bytes`, by default)."""
    total = machine_memory_bytes() if machine_bytes is None else machine_bytes
    return max(1, int(total * DEFAULT_SHARE))


def _cgroup_limit_bytes() -> int | None:
    # cgroup v2, then v1; "max" (or v1's huge number) means no limit.
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
        return None
    return None
