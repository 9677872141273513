"""The per-key cap on input held in Redis: batch input lines and uploaded files, counted together.

``rq:batch-input:<owner>`` is a hash: item id -> bytes it holds. An item is a batch (its valid
input lines, held while it runs) or an uploaded file (``file_...``, held until deleted or expired).
A reservation first drops the items whose data is gone, then counts the new one if the owner's
total stays within ``ROLLOUT_BATCH_MAX_STORED_BYTES_PER_KEY``.
"""

from __future__ import annotations

import redis

from domain.batches.keys import batch_key, data_key, lines_key, owner_input_key

# KEYS: the owner's input hash. ARGV: item id, its bytes, the owner's cap, seconds the hash must
# live at least (the new item's keys), and the key templates (``%s``: an id) of a file's data, a
# batch and a batch's lines. Returns -1 when the bytes fit (and counts them), else the
# bytes the owner's other items hold. The item's own earlier count is replaced, not added to (a
# batch's intake counts its lines as it reads them). It reads each listed item's keys by name (not
# declared in KEYS): fine on one Redis, as this service runs it, not on Redis Cluster.
_RESERVE = """
local held = 0
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local id = entries[i]
  if id ~= ARGV[1] then
    local alive
    if string.sub(id, 1, 5) == 'file_' then
      alive = redis.call('EXISTS', string.format(ARGV[5], id)) == 1
    else
      alive = redis.call('EXISTS', string.format(ARGV[7], id)) == 1
        or redis.call('HGET', string.format(ARGV[6], id), 'status') == 'validating'
    end
    if alive then
      held = held + tonumber(entries[i + 1])
    else
      redis.call('HDEL', KEYS[1], id)
    end
  end
end
if held + tonumber(ARGV[2]) > tonumber(ARGV[3]) then return held end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[4]) then redis.call('EXPIRE', KEYS[1], ARGV[4]) end
return -1
"""


# Ids are plausible ids (letters, digits, - and _), never a ``%``.
_KEY_TEMPLATES = (data_key("%s"), batch_key("%s"), lines_key("%s"))


class StoredInput:
    def __init__(self, client: redis.Redis):
        self.redis = client
        self._reserve = client.register_script(_RESERVE)

    def reserve(self, owner: str, item_id: str, size: int, *, cap: int, ttl: int) -> int | None:
        """Count ``size`` bytes of ``item_id`` against ``owner``'s ``cap``. None when they fit; else
        nothing is counted and the answer is the bytes the owner's other items hold."""
        held = self._reserve(keys=[owner_input_key(owner)],
                             args=[item_id, size, cap, max(1, ttl), *_KEY_TEMPLATES])
        return None if held == -1 else int(held)

    def forget(self, owner: str, item_id: str, pipe=None) -> None:
        (pipe or self.redis).hdel(owner_input_key(owner), item_id)
