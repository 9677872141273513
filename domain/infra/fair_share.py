"""Fairness between API keys: how many worker slots a single key may hold at once.

The problem: a key controls how slow its work is (media that drip just under the deadline,
webhook receivers that hang). A worker runs a fixed number of tasks at once, and Celery hands
messages out in queue order, so one key with many slow tasks queued fills every slot and another
key's work waits behind all of them.

What Celery and Redis give us, and why this shape:

- Per-key queues would need a queue per key declared on every worker (keys come and go), and
  kombu's round-robin over queues only decides the *order* messages are taken, not how many of a
  key's slow tasks run at once: the slots still fill with one key's work.
- Priorities and routing are per message, not per key; a rate limit counts starts, not how long
  a task holds its slot.
- Giving a message back with a countdown (an ETA) looks simple, but Celery holds ETA messages in
  the worker's memory and keeps fetching more, so a key with thousands of queued jobs would be
  pulled into memory and retried every second, a busy loop.
- So: enough slots (prefork processes for preprocessing, threads for webhooks), a per-key limit
  below the slot count, and *parking*. A task whose key holds its share puts its message in the
  key's parked list (one atomic step with the check) and returns; its slot goes to the next
  message, which may be another key's. The task that gives a slot of the key back wakes the
  key's next parked message (republishes it, the slot reserved for it), so a key alone still runs
  ``per_key`` tasks at once, with no polling.

The share counts across all workers of a kind (one Redis key per kind and owner), so a key holds
at most ``per_key`` of the fleet's slots of that kind.

Redis layout (``<kind>`` is ``cpu`` or ``webhooks``):

    rq:share:<kind>:<owner>          zset: held slots, member -> lease end (unix time)
    rq:share:<kind>:<owner>:parked   list: parked messages (JSON), oldest first
    rq:share:<kind>:waking           zset: woken messages being republished -> when woken
    rq:share:<kind>:owners           set: owners with parked messages

Crashes: a task killed without releasing (a hard time limit, a killed process) leaves a lease
that lapses after ``lease_s``, the longest such a task can run; a redelivered message of the same
job finds its own member and keeps the slot. A woken message stays in ``waking`` until it is
republished; :meth:`KeyShare.sweep`, run every few seconds by each worker, republishes what a dead
worker left there and wakes parked messages whose key has free slots again (its leases lapsed).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger(__name__)

# A woken message not republished after this long was woken by a worker that died.
WAKING_STALE_S = 30.0
SWEEP_EVERY_S = 5.0

# KEYS: slots, parked, owners. ARGV: now, member, limit, lease end, ttl, parked entry ('' parks
# nothing), owner.
_ACQUIRE_OR_PARK = """
local now, member, limit = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], member) or redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], ARGV[4], member)
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  return 1
end
if ARGV[6] ~= '' then
  redis.call('RPUSH', KEYS[2], ARGV[6])
  redis.call('SADD', KEYS[3], ARGV[7])
end
return 0
"""

# KEYS: slots, parked, owners, waking. ARGV: member ('' for none), now, limit, owner, lease end.
# Frees the member's slot, then moves as many parked messages as there are free slots to waking,
# each with its slot reserved (so no other message of the key takes it before the woken one runs).
_RELEASE_AND_WAKE = """
local now, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local woken = {}
for _ = 1, limit - redis.call('ZCARD', KEYS[1]) do
  local entry = redis.call('LPOP', KEYS[2])
  if not entry then break end
  redis.call('ZADD', KEYS[4], now, entry)
  redis.call('ZADD', KEYS[1], ARGV[5], cjson.decode(entry)['member'])
  woken[#woken + 1] = entry
end
if redis.call('LLEN', KEYS[2]) == 0 then redis.call('SREM', KEYS[3], ARGV[4]) end
return woken
"""

# KEYS: waking. ARGV: entry, stale before, now. One sweeper claims a stale entry, not several.
_CLAIM_STALE = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) <= tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
  return 1
end
return 0
"""

Publish = Callable[[str, list, dict, str], Any]  # (task name, args, kwargs, queue)


class KeyShare:
    """At most ``per_key`` slots of ``kind`` held by one owner at once; the rest park."""

    def __init__(self, client: redis.Redis, kind: str, *, per_key: int, lease_s: float):
        self.redis = client
        self.kind = kind
        self.per_key = per_key
        self.lease_s = lease_s
        self._acquire = client.register_script(_ACQUIRE_OR_PARK)
        self._release = client.register_script(_RELEASE_AND_WAKE)
        self._claim = client.register_script(_CLAIM_STALE)

    def _keys(self, owner: str) -> list[str]:
        base = f"rq:share:{self.kind}"
        return [f"{base}:{owner}", f"{base}:{owner}:parked", f"{base}:owners", f"{base}:waking"]

    def acquire_or_park(self, owner: str, member: str, *, task: str, args: list, kwargs: dict, queue: str) -> bool:
        """Take a slot for ``member`` (a job, an attempt) of ``owner``, or park the message
        ``task(*args, **kwargs)`` on ``queue`` when the owner holds its share. Taking a slot
        ``member`` already holds renews its lease."""
        entry = json.dumps({"task": task, "args": args, "kwargs": kwargs, "queue": queue, "member": member})
        return self._take(owner, member, entry)

    def acquire(self, owner: str, member: str) -> bool:
        """Take a slot, or False when the owner holds its share (nothing is parked)."""
        return self._take(owner, member, "")

    def _take(self, owner: str, member: str, entry: str) -> bool:
        now = time.time()
        return bool(self._acquire(keys=self._keys(owner)[:3],
                                  args=[now, member, self.per_key, now + self.lease_s, int(self.lease_s) + 60,
                                        entry, owner]))

    def release(self, owner: str, member: str, publish: Publish | None = None) -> None:
        """Give the slot back and republish the owner's next parked messages. Best effort: while
        Redis is away the lease lapses on its own and :meth:`sweep` wakes the parked messages;
        failing here would turn a finished task into a redelivered one."""
        try:
            self._wake(owner, member, publish)
        except redis.RedisError as exc:
            log.warning("share %s: slot of %s not released (%s); its lease lapses", self.kind, member,
                        exc.__class__.__name__)

    def sweep(self, publish: Publish) -> int:
        """Republish what died while being woken, and wake parked messages of owners with free
        slots (their leases lapsed); the number of messages republished."""
        waking = self._keys("")[3]
        now = time.time()
        woken = 0
        for entry in self.redis.zrangebyscore(waking, "-inf", now - WAKING_STALE_S):
            if self._claim(keys=[waking], args=[entry, now - WAKING_STALE_S, now]):
                self._publish(entry, publish)
                woken += 1
        for owner in self.redis.smembers(self._keys("")[2]):
            woken += self._wake(owner.decode(), "", publish)
        return woken

    def entries(self) -> list[bytes]:
        """Every message parked or being woken now (raw JSON), for the sweep that looks for the
        jobs no message carries (``domain/jobs/reaper.py``). Parked first: a message moves from
        parked to waking, so one that moves meanwhile is seen where it arrives."""
        base = self._keys("")
        found: list[bytes] = []
        for owner in self.redis.smembers(base[2]):
            found += self.redis.lrange(self._keys(owner.decode())[1], 0, -1)
        return found + self.redis.zrange(base[3], 0, -1)

    def held(self, owner: str) -> int:
        return int(self.redis.zcount(self._keys(owner)[0], time.time(), "+inf"))

    def parked(self, owner: str) -> int:
        return int(self.redis.llen(self._keys(owner)[1]))

    def _wake(self, owner: str, member: str, publish: Publish | None) -> int:
        now = time.time()
        woken = self._release(keys=self._keys(owner), args=[member, now, self.per_key, owner, now + self.lease_s])
        for entry in woken:
            self._publish(entry, publish)
        return len(woken)

    def _publish(self, entry: bytes, publish: Publish | None) -> None:
        if publish is None:
            raise ValueError("a share with parked messages needs a publish function to wake them")
        message = json.loads(entry)
        publish(message["task"], message["args"], message["kwargs"], message["queue"])
        # Only now: a worker that dies before this line leaves the entry for sweep() to republish.
        self.redis.zrem(self._keys("")[3], entry)


def start_sweeper(share: KeyShare, publish: Publish, every_s: float = SWEEP_EVERY_S) -> threading.Event:
    """Run ``share.sweep`` every ``every_s`` seconds in a daemon thread until the event is set."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                if woken := share.sweep(publish):
                    log.info("share %s: %d parked messages woken by the sweep", share.kind, woken)
            except redis.RedisError:
                pass  # Redis is away: the next sweep tries again
            except Exception:
                log.exception("share %s: sweep failed", share.kind)

    threading.Thread(target=loop, name=f"share-sweep-{share.kind}", daemon=True).start()
    return stop
