"""The adapter registry: one hash of entries and an epoch every change increments.

Like the weight target (domain/weights/store.py) the set is state, not a message: a GPU worker
reads it when it starts and whenever the epoch moves, and converges on it whatever it missed.

Keys:
- ``rq:lora:entries``: hash ``<scope>\\x1f<name>`` -> JSON :class:`AdapterEntry`. ``scope`` is the
  owner id of the key that loaded it, or ``*`` for an admin key's (shared by every key).
- ``rq:lora:epoch``: incremented with every change to the entries (in the same transaction).
- ``rq:lora:seq``: the counter that numbers versions: an engine id (``<scope>/<name>@<seq>``) is
  never given twice, so KV blocks named under one (engine/prefix_hash.py) never serve other weights.
- ``rq:lora:worker:<name>``: JSON :class:`WorkerAdapters`, TTL :data:`WORKER_TTL` (live workers).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields

import redis

ENTRIES_KEY = "rq:lora:entries"
EPOCH_KEY = "rq:lora:epoch"
SEQ_KEY = "rq:lora:seq"
WORKER_PREFIX = "rq:lora:worker:"
WORKER_TTL = 6
SHARED = "*"
MODES = ("finish", "abort", "keep")  # what an in-place update does to the old version's rows


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    scope: str  # the owner id that loaded it, or SHARED
    path: str  # the resolved directory under ROLLOUT_WEIGHTS_ROOT
    version: int  # rq:lora:seq when this version was loaded
    loaded_at: float = field(default_factory=time.time)
    # What the rows of the version it replaced do (load_inplace): finish on it, abort now, or keep
    # going under this version from their next token (their KV as the old one computed it, unless
    # ``recompute_kv``), as a weight update's modes do to every row.
    mode: str = "finish"
    recompute_kv: bool = False

    @property
    def id(self) -> str:
        """What the engine knows it by, and what names its KV blocks."""
        return f"{self.scope}/{self.name}@{self.version}"

    @property
    def shared(self) -> bool:
        return self.scope == SHARED

    def view(self) -> dict:
        return {"name": self.name, "version": self.version, "shared": self.shared, "path": self.path,
                "loaded_at": self.loaded_at, "id": self.id, "mode": self.mode, "recompute_kv": self.recompute_kv}


@dataclass(frozen=True)
class WorkerAdapters:
    worker: str
    epoch: int  # the registry epoch it has applied
    ids: list[str]  # the engine ids it serves
    refused: dict[str, dict] = field(default_factory=dict)  # engine id -> {code, message, errors}
    at: float = field(default_factory=time.time)


def _field(scope: str, name: str) -> str:
    return f"{scope}\x1f{name}"


class AdapterRegistry:
    def __init__(self, client: redis.Redis):
        self.redis = client

    def entries(self) -> list[AdapterEntry]:
        return [AdapterEntry(**json.loads(raw)) for raw in self.redis.hvals(ENTRIES_KEY)]

    def epoch(self) -> int:
        return int(self.redis.get(EPOCH_KEY) or 0)

    def get(self, scope: str, name: str) -> AdapterEntry | None:
        raw = self.redis.hget(ENTRIES_KEY, _field(scope, name))
        return None if raw is None else AdapterEntry(**json.loads(raw))

    def visible(self, owner: str) -> list[AdapterEntry]:
        """What ``owner`` may list and use: its own and the shared ones (its own first by name)."""
        return sorted((e for e in self.entries() if e.scope in (owner, SHARED)),
                      key=lambda e: (e.name, e.shared))

    def resolve(self, owner: str, name: str) -> AdapterEntry | None:
        """The adapter ``name`` means for ``owner``: its own, else a shared one."""
        return self.get(owner, name) or self.get(SHARED, name)

    def count(self, scope: str) -> int:
        return sum(1 for e in self.entries() if e.scope == scope)

    def put(self, *, scope: str, name: str, path: str, mode: str = "finish", recompute_kv: bool = False
            ) -> tuple[AdapterEntry, AdapterEntry | None, int]:
        """A new version of ``name`` in ``scope``: (it, the entry it replaced, the epoch)."""
        entry = AdapterEntry(name, scope, path, int(self.redis.incr(SEQ_KEY)), mode=mode, recompute_kv=recompute_kv)
        key = _field(scope, name)

        def swap(pipe: redis.client.Pipeline):
            raw = pipe.hget(ENTRIES_KEY, key)
            pipe.multi()
            pipe.hset(ENTRIES_KEY, key, json.dumps(asdict(entry)))
            pipe.incr(EPOCH_KEY)
            return raw

        previous_raw = self.redis.transaction(swap, ENTRIES_KEY, value_from_callable=True)
        previous = None if previous_raw is None else AdapterEntry(**json.loads(previous_raw))
        return entry, previous, self.epoch()

    def put_back(self, entry: AdapterEntry, previous: AdapterEntry | None) -> int:
        """Undo :meth:`put` of ``entry`` (refused by the fleet) if it is still the current one."""
        key = _field(entry.scope, entry.name)

        def restore(pipe: redis.client.Pipeline) -> None:
            raw = pipe.hget(ENTRIES_KEY, key)
            if raw is None or AdapterEntry(**json.loads(raw)).version != entry.version:
                return
            pipe.multi()
            if previous is None:
                pipe.hdel(ENTRIES_KEY, key)
            else:
                pipe.hset(ENTRIES_KEY, key, json.dumps(asdict(previous)))
            pipe.incr(EPOCH_KEY)

        self.redis.transaction(restore, ENTRIES_KEY)
        return self.epoch()

    def remove(self, scope: str, name: str) -> AdapterEntry | None:
        key = _field(scope, name)

        def drop(pipe: redis.client.Pipeline):
            raw = pipe.hget(ENTRIES_KEY, key)
            if raw is None:
                return None
            pipe.multi()
            pipe.hdel(ENTRIES_KEY, key)
            pipe.incr(EPOCH_KEY)
            return raw

        raw = self.redis.transaction(drop, ENTRIES_KEY, value_from_callable=True)
        return None if raw is None else AdapterEntry(**json.loads(raw))

    def report(self, record: WorkerAdapters) -> None:
        self.redis.set(WORKER_PREFIX + record.worker, json.dumps(asdict(record)), ex=WORKER_TTL)

    def workers(self) -> list[WorkerAdapters]:
        keys = sorted(self.redis.scan_iter(match=WORKER_PREFIX + "*", count=200))
        known = {f.name for f in fields(WorkerAdapters)}
        return [WorkerAdapters(**{k: v for k, v in json.loads(raw).items() if k in known})
                for raw in (self.redis.mget(keys) if keys else []) if raw is not None]
