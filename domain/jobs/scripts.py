"""The job store's Lua scripts (``domain.jobs.store``): making a job under the queue caps, moving
its status forward only (with its status event, the debts an end owes, and the fence of the run
that moves it), finding ended jobs, numbering a CPU run and saving its prompt while it is the
newest, with the keys and arguments each takes."""

from __future__ import annotations

from domain.infra import redis_reservations, wakeups
from domain.jobs.attempts import fence_lua
from domain.jobs.events import STATUS_EVENT_LUA

# KEYS: job records. Returns the places (from 1) of those ended or gone: one command where a
# pipeline of one HGET each would be as many.
ENDED = """
local terminal = {succeeded=true, failed=true, cancelled=true}
local ended = {}
for place, key in ipairs(KEYS) do
  local status = redis.call('HGET', key, 'status')
  if not status or terminal[status] then table.insert(ended, place) end
end
return ended
"""

# Lua, an expression: whether the record hash at {key} names a webhook of its own (a JSON field,
# ``null`` when it has none). The scripts that end a job or a batch record its debt on it.
OWN_WEBHOOK_LUA = "(redis.call('HGET', {key}, 'webhook') or 'null') ~= 'null'"

# KEYS: job, owner active counter, total active counter, done list, prompt, cancel flag, events,
# unfinished index, webhook debts, uncounted batch lines, the mover's fence counter (attempts.py),
# then the result reservations' three keys (domain/infra/redis_reservations.py).
# ARGV: new status, its rank, now, ttl, events maxlen, '1' when the owner has a key-wide webhook,
# the mover's run number ('' when it has none), then field/value pairs to set with the move.
# Returns 1 when the job moved, FENCED when a newer run began (nothing written); the move's status
# event goes to the job's stream in the same call, and an end that owes a webhook (the job's own, or
# its owner's) or a batch line is recorded as a debt; an end releases the job's result reservation.
TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return -1 end
""" + fence_lua(key="KEYS[11]", number="ARGV[7]") + """
local ranks = {queued=0, preprocessing=1, generating=2, succeeded=3, failed=3, cancelled=3}
local from = ranks[current]
local to = tonumber(ARGV[2])
if from >= 3 or to <= from then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
for i = 8, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
""" + STATUS_EVENT_LUA.format(key="KEYS[7]", maxlen="ARGV[5]", status="ARGV[1]") + """
if from == 0 then redis.call('HSET', KEYS[1], 'started_at', ARGV[3]) end
if to < 3 then redis.call('ZADD', KEYS[8], ARGV[3], redis.call('HGET', KEYS[1], 'id')) end
if to == 3 then
  redis.call('ZREM', KEYS[8], redis.call('HGET', KEYS[1], 'id'))
  redis.call('HSET', KEYS[1], 'completed_at', ARGV[3])
  redis.call('DECR', KEYS[2])
  redis.call('DECR', KEYS[3])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
  -- Wakes a waiter (POST /generate, GET /v1/jobs/{id}?wait=) without polling.
  """ + wakeups.PUSH_LUA.format(key="KEYS[4]", value="ARGV[1]") + """
  redis.call('DEL', KEYS[5], KEYS[6])
  redis.call('EXPIRE', KEYS[7], tonumber(ARGV[4]))
  if ARGV[6] == '1' or """ + OWN_WEBHOOK_LUA.format(key="KEYS[1]") + """ then
    redis.call('ZADD', KEYS[9], 'NX', ARGV[3], redis.call('HGET', KEYS[1], 'id'))
  end
  local batch = redis.call('HGET', KEYS[1], 'batch_id')
  if batch and batch ~= '' then redis.call('ZADD', KEYS[10], 'NX', ARGV[3], redis.call('HGET', KEYS[1], 'id')) end
  """ + redis_reservations.RELEASE_LUA.format(bytes="KEYS[12]", total="KEYS[13]", until="KEYS[14]",
                                              id="redis.call('HGET', KEYS[1], 'id')") + """
end
return 1
"""

# KEYS: job, owner index, owner active counter, total active counter, prompt, events, unfinished index.
# ARGV: per-owner cap, total cap, created_at, the prompt ("" for none), its ttl, events maxlen, then
# the job's field/value pairs. The job's event stream starts with its ``queued`` event.
CREATE = """
if tonumber(redis.call('GET', KEYS[3]) or '0') >= tonumber(ARGV[1]) then return -1 end
if tonumber(redis.call('GET', KEYS[4]) or '0') >= tonumber(ARGV[2]) then return -2 end
for i = 8, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
""" + STATUS_EVENT_LUA.format(key="KEYS[6]", maxlen="ARGV[6]", status="'queued'") + """
redis.call('EXPIRE', KEYS[6], tonumber(ARGV[5]))
redis.call('ZADD', KEYS[2], ARGV[3], redis.call('HGET', KEYS[1], 'id'))
redis.call('ZADD', KEYS[7], ARGV[3], redis.call('HGET', KEYS[1], 'id'))
redis.call('INCR', KEYS[3])
redis.call('INCR', KEYS[4])
if ARGV[4] ~= '' then redis.call('SET', KEYS[5], ARGV[4], 'EX', tonumber(ARGV[5])) end
if ARGV[7] == '1' then redis.call('SET', KEYS[8], 1, 'EX', tonumber(ARGV[5])) end
return 1
"""

# KEYS: preprocess run counter. ARGV: ttl. Returns the new run's number.
CLAIM_PREPROCESSING = """
local run = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return run
"""

# KEYS: job, prompt, preprocess run counter. ARGV: the run's number, the prompt, ttl, '1' when the job
# may be generating (its handles are made again). Returns 1 when saved; 0 when the job moved on
# (ended, or generating from another run's prompt); FENCED when a newer run began.
SAVE_PROMPT = fence_lua(key="KEYS[3]", number="ARGV[1]") + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'succeeded' or status == 'failed' or status == 'cancelled' then return 0 end
if status == 'generating' and ARGV[4] ~= '1' then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[3]))
return 1
"""
