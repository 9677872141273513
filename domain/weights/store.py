"""The fleet's weights in Redis: one target every GPU worker converges on, and what each one serves.

Why a versioned target in Redis rather than a Celery broadcast (``app.control.broadcast``): a
broadcast reaches only the workers connected at that moment, once. A GPU worker that starts later,
or is restarting after a crash, or whose connection to Redis was down, never hears it and would
serve the old weights for good. A target is state, not a message: every worker reads it when it
starts (before it takes work), between batches and from a watcher thread, and converges whenever
it looks, whatever it missed. It is one small hash per fleet, so it works the same for workers on
many nodes against one Redis. Across a Redis restart it survives with Redis' own persistence (the
embedded Redis keeps an append-only file); a worker that cannot reach Redis keeps serving what it
has and looks again when Redis is back. Each worker reports its state under a key with a TTL, so a
dead worker drops out of the report by itself.

Keys:
- ``rq:weights:target``: hash ``id`` (random, new per update), ``version``, ``model_path``,
  ``mode`` (finish | abort | retract | keep), ``recompute_kv`` ("1": mode keep's rows get their
  KV computed again by the new weights), ``set_at``. A worker compares ``id``, not ``version``: the
  same version name set twice (a retry after a failure) is loaded again. ``digest``: empty until
  the first worker loads it, then the content digest of what it loaded (``engine.weights.
  weights_digest``, bound once: :meth:`WeightStore.bind_digest`); every later load of the target
  (another worker, a restart) must read the same content or refuses it.
- ``rq:weights:served``: the last target a worker loaded and served, put back when every live
  worker refused a newer one (a bad directory changes nothing). The workers put it back by their
  own reports (:meth:`WeightStore.put_back`), whether or not the update call still waits, and only
  over the refused target (compare-and-swap): two refused updates in a row leave the served one.
- ``rq:weights:refusal:<target id>``: JSON, the workers' records of a target put back (a day).
- ``rq:weights:pause``: JSON ``{"mode", "at", "id"}`` while generation is paused; ``id`` is new per
  pause, so each pause's stopped rows are counted afresh and its call waits for reports of it.
- ``rq:weights:worker:<name>``: JSON :class:`WorkerWeights`, TTL :data:`WORKER_TTL`.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass, field, fields

import redis

TARGET_KEY = "rq:weights:target"
SERVED_KEY = "rq:weights:served"
REFUSAL_PREFIX = "rq:weights:refusal:"
REFUSAL_TTL = 24 * 3600
PAUSE_KEY = "rq:weights:pause"
WORKER_PREFIX = "rq:weights:worker:"
WORKER_TTL = 6
# keep: rows in flight hold still at the swap and go on under the new weights (engine/weight_crossing.py).
MODES = ("finish", "abort", "retract", "keep")
# A pause in mode keep holds its rows still until it ends (SGLang's in_place, vLLM's keep); a target
# set meanwhile is taken in mode keep whatever its own.
PAUSE_MODES = ("finish", "abort", "retract", "in_place", "keep")

# Worker states. serving: the worker takes work on ``version``. loading: it is swapping weights in.
# failed: the target did not load; it keeps its old weights and takes no work until a new target.
STATES = ("starting", "loading", "serving", "failed")


@dataclass(frozen=True)
class Pause:
    mode: str
    id: str  # random, new per pause

    @classmethod
    def from_json(cls, raw: bytes | None) -> Pause | None:
        if not raw:
            return None
        record = json.loads(raw)
        return cls(record["mode"], record.get("id") or f"at-{record.get('at')}")


@dataclass(frozen=True)
class WeightTarget:
    id: str
    version: str
    model_path: str
    mode: str
    set_at: float
    digest: str = ""
    recompute_kv: bool = False

    @classmethod
    def from_hash(cls, raw: dict) -> WeightTarget | None:
        if not raw:
            return None
        values = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                  for k, v in raw.items()}
        try:
            return cls(values["id"], values["version"], values["model_path"], values["mode"], float(values["set_at"]),
                       values.get("digest", ""), values.get("recompute_kv") == "1")
        except (KeyError, ValueError):
            return None

    def to_hash(self) -> dict[str, str]:
        return {"id": self.id, "version": self.version, "model_path": self.model_path, "mode": self.mode,
                "set_at": repr(self.set_at),
                "digest": self.digest, "recompute_kv": "1" if self.recompute_kv else "0"}


@dataclass(frozen=True)
class WorkerWeights:
    worker: str
    node: str
    state: str
    version: str | None  # the weight version it serves (old weights while loading or after a failure)
    target_id: str | None  # the target it last applied or tried
    paused: bool = False
    pause_id: str | None = None  # the pause it has seen (Pause.id)
    error: dict | None = None  # {code, message} of the last failed load
    interrupted: int = 0  # rows stopped (or held still, keep) by the last update or pause
    at: float = field(default_factory=time.time)


class WeightStore:
    def __init__(self, client: redis.Redis):
        self.redis = client

    def target(self) -> WeightTarget | None:
        return WeightTarget.from_hash(self.redis.hgetall(TARGET_KEY))

    def set_target(self, *, version: str, model_path: str, mode: str, recompute_kv: bool = False) -> WeightTarget:
        """Make this the fleet's target."""
        new = WeightTarget(secrets.token_hex(8), version, model_path, mode, time.time(), recompute_kv=recompute_kv)
        pipe = self.redis.pipeline()  # MULTI: no reader sees half a target
        pipe.delete(TARGET_KEY)
        pipe.hset(TARGET_KEY, mapping=new.to_hash())
        pipe.execute()
        return new

    def bind_digest(self, target_id: str, digest: str) -> str | None:
        """Bind ``digest`` to target ``target_id`` unless it already has one: the digest it is bound
        to now (the first loader's), or None when the target is no longer ``target_id``."""

        def bind(pipe: redis.client.Pipeline) -> str | None:
            current = WeightTarget.from_hash(pipe.hgetall(TARGET_KEY))
            if current is None or current.id != target_id:
                return None
            if current.digest:
                return current.digest
            pipe.multi()
            pipe.hset(TARGET_KEY, "digest", digest)
            return digest

        return self.redis.transaction(bind, TARGET_KEY, value_from_callable=True)

    def mark_served(self, target: WeightTarget) -> None:
        """``target`` loaded and serves on some worker: what a refused newer one is put back to."""
        pipe = self.redis.pipeline()
        pipe.delete(SERVED_KEY)
        pipe.hset(SERVED_KEY, mapping=target.to_hash())
        pipe.execute()

    def put_back(self, refused_id: str, refusals: list[WorkerWeights] = ()) -> bool:
        """Make the last served target the fleet's again, if ``refused_id`` is still the target
        (nobody set a newer one); no target at all when none was ever served (the start-up weights).
        The workers' ``refusals`` are kept for the update call to report (:meth:`refusals`)."""

        def restore(pipe: redis.client.Pipeline) -> bool:
            current = WeightTarget.from_hash(pipe.hgetall(TARGET_KEY))
            if current is None or current.id != refused_id:
                return False
            served = pipe.hgetall(SERVED_KEY)
            pipe.multi()
            pipe.delete(TARGET_KEY)
            if served:
                pipe.hset(TARGET_KEY, mapping=served)
            pipe.set(REFUSAL_PREFIX + refused_id, json.dumps([asdict(w) for w in refusals]), ex=REFUSAL_TTL)
            return True

        return bool(self.redis.transaction(restore, TARGET_KEY, value_from_callable=True))

    def refusals(self, target_id: str) -> list[WorkerWeights] | None:
        """The workers' refusals of a target that was put back; None when it was not."""
        raw = self.redis.get(REFUSAL_PREFIX + target_id)
        return None if raw is None else [WorkerWeights(**record) for record in json.loads(raw)]

    def refused_everywhere(self, target_id: str) -> list[WorkerWeights] | None:
        """Every live worker's record when each reports ``target_id`` failed (at least one); else None."""
        workers = self.workers()
        refused = bool(workers) and all(w.target_id == target_id and w.state == "failed" for w in workers)
        return workers if refused else None

    def pause(self, mode: str) -> Pause:
        pause = Pause(mode, secrets.token_hex(8))
        self.redis.set(PAUSE_KEY, json.dumps({"mode": mode, "at": time.time(), "id": pause.id}))
        return pause

    def resume(self) -> None:
        self.redis.delete(PAUSE_KEY)

    def paused(self) -> str | None:
        """The pause mode while generation is paused, else None."""
        pause = Pause.from_json(self.redis.get(PAUSE_KEY))
        return pause.mode if pause else None

    def read(self) -> tuple[WeightTarget | None, Pause | None]:
        """Target and pause in one round trip (what a worker's watcher reads)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(TARGET_KEY)
        pipe.get(PAUSE_KEY)
        raw_target, raw_pause = pipe.execute()
        return WeightTarget.from_hash(raw_target), Pause.from_json(raw_pause)

    def report(self, record: WorkerWeights) -> None:
        self.redis.set(WORKER_PREFIX + record.worker, json.dumps(asdict(record)), ex=WORKER_TTL)

    def workers(self) -> list[WorkerWeights]:
        """Every live GPU worker's record (a dead one's expires within WORKER_TTL), by name."""
        keys = sorted(self.redis.scan_iter(match=WORKER_PREFIX + "*", count=200))
        records = []
        known = {f.name for f in fields(WorkerWeights)}
        for raw in self.redis.mget(keys) if keys else []:
            if raw is not None:  # a worker of another release may report more fields: read ours
                records.append(WorkerWeights(**{k: v for k, v in json.loads(raw).items() if k in known}))
        return records
