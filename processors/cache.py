"""The multimodal cache: processed features of one media item, shared by a node's CPU workers.

Keyed by the content part's ``uuid`` when the client gave one (a hit then skips fetching
entirely), else by the sha256 of the media bytes, together with the model id, the modality and
the processor options. A uuid is only a name the client chose, so a uuid entry belongs to the
API key (``owner``) that made it: its key holds the owner, and another key using the same uuid
never reads it nor overwrites it. An entry found by the sha256 of the bytes may be shared: only
someone who already holds the same bytes can hit it. Values are the per-image features after the model hook, as safetensors
bytes in Redis, so a hit gives bit-identical tensors.

Each worker process also keeps the entries it used last in memory (``local_max_bytes``, LRU;
``ROLLOUT_MM_CACHE_PROCESS_BYTES``):
a repeated image then costs no Redis transfer and no deserialization, only a touch of its
last-use time in Redis so the shared LRU order stays true. The content hash finalize computed
is stored with the features, so a hit does not hash them again.

Size is capped with least-recently-used eviction. Redis' own ``maxmemory-policy`` cannot do it:
it acts on the whole instance, which also holds the broker and the job store. Each entry's last
use is its score in a sorted set and a counter tracks the stored bytes; a Lua script stores an
entry and evicts the oldest ones until the total is under the cap, atomically, so concurrent
workers never double-count or over-evict.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

_PUT = """
local size = string.len(ARGV[1])
local old = redis.call('STRLEN', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
local total = redis.call('INCRBY', KEYS[3], size - old)
local evicted = 0
while total > tonumber(ARGV[3]) do
  local oldest = redis.call('ZPOPMIN', KEYS[2])
  if #oldest == 0 then break end
  total = redis.call('DECRBY', KEYS[3], redis.call('STRLEN', oldest[1]))
  redis.call('DEL', oldest[1])
  evicted = evicted + 1
end
return evicted
"""


@dataclass(frozen=True)
class CachedFeatures:
    features: dict[str, torch.Tensor]  # shared with the cache: read, never modify in place
    content_hash: str

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.features.values())


class MultimodalCache:
    def __init__(
        self, client: redis.Redis, *, max_bytes: int, namespace: str = "rq:mmcache",
        local_max_bytes: int = 256 * 1024 * 1024,
    ):
        if max_bytes <= 0 or local_max_bytes < 0:
            raise ValueError("max_bytes must be positive and local_max_bytes not negative")
        self._redis = client
        self.max_bytes = max_bytes
        self.local_max_bytes = local_max_bytes
        self._local: OrderedDict[str, CachedFeatures] = OrderedDict()
        self._local_bytes = 0
        self._lock = threading.Lock()  # the local tier is shared by a threads-pool worker's tasks
        self._prefix = f"{namespace}:v:"
        self._lru = f"{namespace}:lru"
        self._bytes = f"{namespace}:bytes"
        self._put = client.register_script(_PUT)

    @staticmethod
    def key(
        *, model_id: str, modality: str, options: Mapping[str, Any], uuid: str | None = None,
        owner: str | None = None, media_sha256: str | None = None,
    ) -> str:
        """The cache key of one media item: its owner's uuid or its bytes' sha256, plus everything
        that changes what the processor makes of it."""
        if (uuid is None) == (media_sha256 is None):
            raise ValueError("give exactly one of uuid and media_sha256")
        if (uuid is not None) != bool(owner):
            raise ValueError("a uuid key needs its owner (and only a uuid key has one)")
        source = {"uuid": uuid, "owner": owner} if uuid is not None else {"sha256": media_sha256}
        blob = json.dumps(
            {"model": model_id, "modality": modality, "options": dict(options), **source},
            sort_keys=True, separators=(",", ":"), default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str) -> CachedFeatures | None:
        name = self._prefix + key
        with self._lock:
            entry = self._local.get(key)
            if entry is not None:
                self._local.move_to_end(key)
        if entry is None:
            data = self._redis.get(name)
            if data is None:
                return None
            entry = CachedFeatures(load_safetensors(data), _metadata(data)["content_hash"])
            self._remember(key, entry)
        # XX: only refresh an entry still there (another worker may just have evicted it).
        self._redis.zadd(self._lru, {name: time.time()}, xx=True)
        return entry

    def put(self, key: str, features: Mapping[str, torch.Tensor], content_hash: str) -> bool:
        """Store ``features`` (and the content hash finalize gave them); False when one entry
        alone is larger than the cap."""
        owned = {name: _owned(t) for name, t in features.items()}
        data = save_safetensors(owned, metadata={"content_hash": content_hash})
        if len(data) > self.max_bytes:
            return False
        self._put(keys=[self._prefix + key, self._lru, self._bytes], args=[data, time.time(), self.max_bytes])
        self._remember(key, CachedFeatures(owned, content_hash))
        return True

    def _remember(self, key: str, entry: CachedFeatures) -> None:
        if entry.nbytes > self.local_max_bytes:
            return
        with self._lock:
            old = self._local.pop(key, None)
            self._local_bytes += entry.nbytes - (old.nbytes if old else 0)
            self._local[key] = entry
            while self._local_bytes > self.local_max_bytes:
                _, evicted = self._local.popitem(last=False)
                self._local_bytes -= evicted.nbytes

    def total_bytes(self) -> int:
        return int(self._redis.get(self._bytes) or 0)

    def __len__(self) -> int:
        return int(self._redis.zcard(self._lru))

    def clear_local(self) -> None:
        """Forget this process's in-memory entries (Redis keeps them)."""
        with self._lock:
            self._local.clear()
            self._local_bytes = 0

    def clear(self) -> None:
        """Remove every entry of this namespace, in Redis and in this process."""
        self.clear_local()
        names = self._redis.zrange(self._lru, 0, -1)
        pipe = self._redis.pipeline()
        if names:
            pipe.delete(*names)
        pipe.delete(self._lru, self._bytes)
        pipe.execute()


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if it is all of its storage, else a copy: a view into a bundle of several
    images must not keep the whole bundle alive in the local tier."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone()


def _metadata(data: bytes) -> dict[str, str]:
    # safetensors.torch.load drops the header's metadata; the format is documented: an 8-byte
    # little-endian header length, then the JSON header holding "__metadata__".
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length])["__metadata__"]
