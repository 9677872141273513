"""What accepted work will still write, reserved against Redis' headroom.

Redis' used memory alone says nothing of the jobs accepted but not yet ended: their results come
later, and a burst of submits all read the same room free (#56: 1,850 jobs accepted past the mark,
then the workers' writes refused for memory). So each job's worst-case result
(``engine/result_bound.py``) is reserved as it is accepted, in one script with the check: new work
is refused (503 ``redis_memory_full``) when used memory, what is reserved and what it asks for
would pass the high-water mark. A bulk submit's or a dialect batch's jobs are reserved all at once,
or none is.

The store: ``rq:reserve:bytes`` (job id → bytes), ``rq:reserve:total`` (their sum) and
``rq:reserve:until`` (job id → when its reservation lapses). The script that ends a job releases
its reservation in the same call that writes its result (``domain/jobs/scripts.py`` TRANSITION,
with :data:`RELEASE_LUA`); a reservation whose job never came to be (the API died between the two
calls) or outlives :data:`LIFETIME_SECONDS` lapses at the next reserve, so none leaks for good.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis

from domain.infra.redis_memory import HIGH_WATER, RESERVED_TOTAL_KEY, MemoryUse
from domain.infra.store_errors import StoreFull

BYTES_KEY = "rq:reserve:bytes"
TOTAL_KEY = RESERVED_TOTAL_KEY
UNTIL_KEY = "rq:reserve:until"
KEYS = (BYTES_KEY, TOTAL_KEY, UNTIL_KEY)
# A reservation lapses after this: longer than a job waits and runs under the queue caps.
LIFETIME_SECONDS = 24 * 3600
_LAPSED_PER_CALL = 512  # reservations a reserve call lets lapse at most: each call's work is bounded

# Lua: release the reservation of the job id ``{id}`` (an expression), given the three keys.
RELEASE_LUA = """
local held = redis.call('HGET', {bytes}, {id})
if held then
  redis.call('HDEL', {bytes}, {id})
  redis.call('ZREM', {until}, {id})
  redis.call('DECRBY', {total}, held)
end
"""

# KEYS: bytes, total, until. ARGV: now, lifetime, high-water share, then job id / bytes pairs.
# Returns {1 reserved | 0 refused, used memory, maxmemory, reserved before this call}. INFO inside
# the script: used memory as it is now, not a second-old reading.
_RESERVE = """
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[1], 'LIMIT', 0, """ + str(_LAPSED_PER_CALL) + """)
for _, id in ipairs(lapsed) do
""" + RELEASE_LUA.format(bytes="KEYS[1]", total="KEYS[2]", until="KEYS[3]", id="id") + """
end
local info = redis.call('INFO', 'memory')
local used = tonumber(string.match(info, 'used_memory:(%d+)'))
local max = tonumber(string.match(info, 'maxmemory:(%d+)') or '0')
local reserved = tonumber(redis.call('GET', KEYS[2]) or '0')
local want = 0
for i = 4, #ARGV, 2 do want = want + tonumber(ARGV[i + 1]) end
if max > 0 and used + reserved + want > max * tonumber(ARGV[3]) then return {0, used, max, reserved} end
local untl = tonumber(ARGV[1]) + tonumber(ARGV[2])
for i = 4, #ARGV, 2 do
""" + RELEASE_LUA.format(bytes="KEYS[1]", total="KEYS[2]", until="KEYS[3]", id="ARGV[i]") + """
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[3], untl, ARGV[i])
end
redis.call('INCRBY', KEYS[2], want)
return {1, used, max, reserved}
"""


class Reservations:
    """The API's side: :meth:`reserve` before jobs are created, :meth:`release` for those that were not."""

    def __init__(self, client: redis.Redis, *, high_water: float = HIGH_WATER, lifetime: int = LIFETIME_SECONDS,
                 clock=time.time):
        self.redis, self.high_water, self.lifetime, self.clock = client, high_water, lifetime, clock
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(
            "for _, id in ipairs(ARGV) do\n"
            + RELEASE_LUA.format(bytes="KEYS[1]", total="KEYS[2]", until="KEYS[3]", id="id") + "end\n")

    def reserve(self, bounds: Sequence[tuple[str, int]]) -> None:
        """Reserve each ``(job id, bytes)``, all or none: :class:`StoreFull` (503, with
        Retry-After) when they do not fit below the high-water mark. Redis without ``maxmemory``
        takes everything (and the reservations are kept all the same, for /healthz)."""
        if not bounds:
            return
        args: list = [self.clock(), self.lifetime, self.high_water]
        for job_id, size in bounds:
            args += [job_id, int(size)]
        taken, used, maxmemory, reserved = (int(v) for v in self._reserve(keys=list(KEYS), args=args))
        if not taken:
            raise MemoryUse(used, maxmemory, self.high_water, reserved).refusal(
                sum(size for _, size in bounds))

    def release(self, job_ids: Sequence[str]) -> None:
        if job_ids:
            self._release(keys=list(KEYS), args=list(job_ids))

    def reserved_bytes(self) -> int:
        return int(self.redis.get(TOTAL_KEY) or 0)


__all__ = ["KEYS", "RELEASE_LUA", "Reservations", "StoreFull"]
