"""Fairness between API keys: how many slots of one worker a single key may hold at once.

The problem: a key controls how slow its work is (media that drip just under the deadline,
webhook receivers that hang). A worker runs a fixed number of tasks at once, and Celery hands
messages out in queue order, so one key with many slow tasks queued fills every slot and another
key's work waits behind all of them.

What Celery and Redis give us, and why this shape:

- Per-key queues would need a queue per key declared on every worker (keys come and go) and
  kombu's round-robin over them only decides the *order* messages are taken, not how many of a
  key's slow tasks run at once: the slots still fill with one key's work.
- Priorities and routing are per message, not per key; a rate limit counts starts, not how long
  a task holds its slot.
- So: enough slots (prefork processes for preprocessing, threads for webhooks), and a per-key
  in-flight limit that is below the slot count. A task whose key already holds its share gives its
  message back to the queue with a short countdown and returns; the slot goes to the next
  message, which may be another key's. A key alone still uses ``per_key`` slots at once.

The limit is per worker (``scope`` names the worker), because slots belong to one worker: a
message one worker gives back may run on another that has room for the key.

Each held slot is a member of a Redis sorted set per key and scope, scored by the time its lease
ends. A task releases its slot when it ends; a task killed without ending (a hard time limit, a
killed process) leaves a lease that lapses after ``lease_s``, the longest such a task can run. A
redelivered message of the same job finds its own member and keeps the slot.
"""

from __future__ import annotations

import logging
import time

import redis

log = logging.getLogger(__name__)

# How long a message waits before it is tried again when its key holds its share. Short, so a
# key's next task starts soon after one of its slots frees; long enough that a key's waiting
# messages do not spin a worker.
DEFER_S = 1.0

_ACQUIRE = """
local now, member, limit, lease_end, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], member) and redis.call('ZCARD', KEYS[1]) >= limit then
  return 0
end
redis.call('ZADD', KEYS[1], lease_end, member)
redis.call('EXPIRE', KEYS[1], ttl)
return 1
"""


class KeyShare:
    """At most ``per_key`` slots of ``scope`` held by one owner at once."""

    def __init__(self, client: redis.Redis, scope: str, *, per_key: int, lease_s: float):
        self.redis = client
        self.scope = scope
        self.per_key = per_key
        self.lease_s = lease_s
        self._acquire = client.register_script(_ACQUIRE)

    def key(self, owner: str) -> str:
        return f"rq:share:{self.scope}:{owner}"

    def acquire(self, owner: str, member: str) -> bool:
        """Take a slot for ``member`` (a job, an attempt) of ``owner``; False when the owner holds
        its share. Taking a slot ``member`` already holds renews its lease."""
        now = time.time()
        return bool(self._acquire(keys=[self.key(owner)],
                                  args=[now, member, self.per_key, now + self.lease_s, int(self.lease_s) + 60]))

    def release(self, owner: str, member: str) -> None:
        """Give the slot back. Best effort: while Redis is away the lease lapses on its own, and
        failing here would turn a finished task into a redelivered one."""
        try:
            self.redis.zrem(self.key(owner), member)
        except redis.RedisError as exc:
            log.warning("share %s: slot of %s not released (%s); its lease lapses", self.scope, member,
                        exc.__class__.__name__)

    def held(self, owner: str) -> int:
        return int(self.redis.zcount(self.key(owner), time.time(), "+inf"))
