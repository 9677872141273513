"""The batch store's Lua scripts (``domain.batches.store``): each write that must be one step
(a status move with the webhook debt it owes, counting lines once, settling debts only where the
work is recorded, marking a chunk submitted, closing the intake), with the keys and arguments each
takes."""

from __future__ import annotations

from domain.batches.statuses import TERMINAL
from domain.infra import wakeups
from domain.jobs.scripts import OWN_WEBHOOK_LUA

# KEYS: batch hash, webhook debts, the batch's wake-up list. ARGV: new status, allowed current
# statuses (comma separated), now, the timestamp field ('' for none), then the owners with a
# key-wide webhook. An end that owes a webhook event (the batch's own, or its owner's) records the
# debt in the same write, so a failover cannot keep the end and lose the debt; an end also wakes
# the batch's waiters (GET /v1/batches/{id}?wait=).
TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return -1 end
local allowed = false
for status in string.gmatch(ARGV[2], '[^,]+') do
  if status == current then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], ARGV[4], ARGV[3]) end
local ends = {""" + ", ".join(f"{status}=true" for status in sorted(TERMINAL)) + """}
if ends[ARGV[1]] then
  local owed = """ + OWN_WEBHOOK_LUA.format(key="KEYS[1]") + """
  local owner = redis.call('HGET', KEYS[1], 'owner')
  for i = 5, #ARGV do owed = owed or ARGV[i] == owner end
  if owed then redis.call('ZADD', KEYS[2], 'NX', ARGV[3], redis.call('HGET', KEYS[1], 'id')) end
  """ + wakeups.PUSH_LUA.format(key="KEYS[3]", value="ARGV[1]") + """
end
return 1
"""

# KEYS: batch hash, ended set, output list, errors list.
# ARGV: triples of (line number, 'completed' | 'failed', JSON entry).
# Counts each line once. Returns 1 to the one call that counts the batch's last line ("settles" it);
# a batch whose file is still being read (``intake`` set) settles when the intake closes (CLOSE).
RECORD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local expire_at = tonumber(redis.call('HGET', KEYS[1], 'keys_expire_at'))
local new = {completed = {}, failed = {}}
for i = 1, #ARGV, 3 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    table.insert(new[ARGV[i + 1]], ARGV[i + 2])
  end
end
-- One push, expiry and count per list, not per line (a call holds at most PAGE lines).
for status, target in pairs({completed = KEYS[3], failed = KEYS[4]}) do
  if #new[status] > 0 then
    redis.call('RPUSH', target, unpack(new[status]))
    redis.call('EXPIREAT', target, expire_at)
    redis.call('HINCRBY', KEYS[1], status, #new[status])
  end
end
redis.call('EXPIREAT', KEYS[2], expire_at)
local done = tonumber(redis.call('HGET', KEYS[1], 'completed')) + tonumber(redis.call('HGET', KEYS[1], 'failed'))
if done >= tonumber(redis.call('HGET', KEYS[1], 'total')) and redis.call('HEXISTS', KEYS[1], 'intake') == 0
    and redis.call('HSETNX', KEYS[1], 'settled', 1) == 1 then
  return 1
end
return 0
"""

# A debt (a line to count, a chunk to score) is dropped only where the work it stands for is
# recorded, or where its batch is gone: in a split brain, the work's write can go to an old primary
# (through a connection made before the switch) and be lost, while the debt's drop reaches the new
# one; the debt must then stay for the batch reaper.
# KEYS: the debts (a sorted set or a set), then per item its batch's hash and ended-lines set.
# ARGV: the command that drops a debt (ZREM or SREM), then per item the debt's member and the line
# numbers it stands for, joined by ','. Returns how many items' work is recorded (their debts dropped).
SETTLE_COUNTED = """
local settled = 0
for i = 2, #ARGV, 2 do
  local batch, ended = KEYS[i], KEYS[i + 1]
  local counted = true
  if redis.call('EXISTS', batch) == 1 then
    for line in string.gmatch(ARGV[i + 1], '[^,]+') do
      if redis.call('SISMEMBER', ended, line) == 0 then counted = false break end
    end
  end
  if counted then
    redis.call(ARGV[1], KEYS[1], ARGV[i])
    settled = settled + 1
  end
end
return settled
"""

# A chunk is marked submitted only where each of its lines is counted, or mapped to what it was
# given (a job whose record is here, or ``DIRECT_LINE``): in a split brain, the jobs or their mapping
# can go to an old primary and be lost while the mark reaches the new one, and a marked chunk is not
# looked at again. Unmarked, the batch reaper sends it again, and ``enqueue_chunk`` makes what is missing.
# KEYS: the submitted set, the batch's hash, ended set and jobs hash, then per line its job's record
# (the batch's hash where the line has no job: it must be counted).
# ARGV: the chunk's index, the keys' expiry, ``DIRECT_LINE``, then per line its number and job id
# ('' where none).
# Returns 1 when marked, 0 when something is missing, -1 when the batch is gone.
MARK_SUBMITTED = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
for i = 4, #ARGV, 2 do
  local line, job = ARGV[i], ARGV[i + 1]
  if redis.call('SISMEMBER', KEYS[3], line) == 0 then
    if job == '' or redis.call('HGET', KEYS[4], line) ~= job then return 0 end
    if job ~= ARGV[3] and redis.call('EXISTS', KEYS[(i - 4) / 2 + 5]) == 0 then return 0 end
  end
end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIREAT', KEYS[1], ARGV[2])
return 1
"""

# KEYS: batch hash. Ends the intake; returns 1 when every line was counted already (the caller
# settles the batch), 0 if not, -1 if the batch is gone.
CLOSE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('HDEL', KEYS[1], 'intake')
local done = tonumber(redis.call('HGET', KEYS[1], 'completed')) + tonumber(redis.call('HGET', KEYS[1], 'failed'))
if done >= tonumber(redis.call('HGET', KEYS[1], 'total')) and redis.call('HSETNX', KEYS[1], 'settled', 1) == 1 then
  return 1
end
return 0
"""
