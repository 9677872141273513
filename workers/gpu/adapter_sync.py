"""A GPU worker's side of the adapter registry (domain/adapters/): serve the fleet's set.

A watcher thread reads the registry's epoch every ``poll_seconds``; when it moved, it loads the
adapters new to it and retires the ones gone (their running rows finish: engine/lora/bank.py), then
reports the epoch it applied and the adapters it refused (each with its typed error), which the
load call waits for. Loads need no pause of the batch: the engine copies an adapter into its slot
under the model's lock, between two forwards, and no row runs under it before that. The worker's
start applies the set once before it takes work (``workers/runtimes.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from pathlib import Path

import redis

from domain.adapters.store import AdapterRegistry, WorkerAdapters
from domain.weights.paths import WeightUpdatesDisabledError
from engine.errors import InternalError, RolloutError

log = logging.getLogger(__name__)


def engine_adapter(adapter_id: str, served: Iterable[str] = ()) -> str:
    """The engine id a stored job runs under (``StoredJob.adapter_id``): the one the API resolved,
    or the version of that adapter ``served`` now when an in-place update replaced it while the job
    was queued (as a queued job runs on the weights serving when it starts); a name nobody resolved
    (a batch line's ``adapter``) is no engine id, so the engine refuses it (``adapter_not_found``)
    rather than answer with the base, as it refuses an adapter since unloaded."""
    served = list(served)
    if not adapter_id or adapter_id in served:
        return adapter_id
    return next((current for current in served if _name(current) == _name(adapter_id)), adapter_id)


def _name(adapter_id: str) -> str:
    """``<scope>/<name>`` of an engine id ``<scope>/<name>@<version>``."""
    return adapter_id.rpartition("@")[0]


class AdapterSync:
    def __init__(self, registry: AdapterRegistry, engine, *, worker: str, weights_root: Path | None,
                 poll_seconds: float = 0.2):
        self.registry, self.engine, self.worker = registry, engine, worker
        self.weights_root, self.poll_seconds = weights_root, poll_seconds
        self.epoch = -1
        self._refused: dict[str, dict] = {}
        self._stop = threading.Event()

    def sync(self) -> None:
        """Apply the registry's set if its epoch moved, and report (which keeps this worker live)."""
        epoch = self.registry.epoch()  # read first: entries at least this new are applied
        if epoch != self.epoch:
            wanted = {entry.id: entry for entry in self.registry.entries()}
            for adapter_id, entry in sorted(wanted.items()):
                if adapter_id not in self.engine.adapter_ids and adapter_id not in self._refused:
                    self._load(adapter_id, entry.path)
            self._refused = {k: v for k, v in self._refused.items() if k in wanted}
            # A version replaced in place retires once its successor serves: a refused new version
            # leaves the old one serving until the load call puts it back in the registry.
            refused_names = {_name(adapter_id) for adapter_id in self._refused}
            successors = {_name(adapter_id): entry for adapter_id, entry in wanted.items()}
            for adapter_id in set(self.engine.adapter_ids) - set(wanted):
                if _name(adapter_id) not in refused_names:
                    successor = successors.get(_name(adapter_id))
                    if successor is not None and successor.mode == "abort":
                        aborted = self.engine.abort_adapter(adapter_id)  # its rows end at their next step
                        log.info("adapter %s replaced in mode abort: %d requests aborted", adapter_id, aborted)
                    elif successor is not None and successor.mode == "keep":  # its rows go on under the successor
                        self.engine.replace_adapter(adapter_id, successor.id, recompute_kv=successor.recompute_kv)
                        log.info("adapter %s replaced in mode keep by %s", adapter_id, successor.id)
                    self.engine.unload_adapter(adapter_id)
            self.epoch = epoch
        self.registry.report(WorkerAdapters(self.worker, self.epoch, self.engine.adapter_ids, dict(self._refused)))

    def _load(self, adapter_id: str, path: str) -> None:
        try:
            if self.weights_root is None:
                raise WeightUpdatesDisabledError("adapters are not enabled: set ROLLOUT_WEIGHTS_ROOT")
            self.engine.load_adapter(adapter_id, path, root=self.weights_root)
            log.info("adapter %s loaded from %s", adapter_id, path)
        except RolloutError as error:
            self._refused[adapter_id] = error.to_dict()
        except Exception:  # an unreadable file, a bug: refused here, the worker goes on serving
            log.exception("adapter %s failed to load", adapter_id)
            self._refused[adapter_id] = InternalError("the adapter failed to load").to_dict()

    def start(self) -> threading.Thread:
        """Apply the set now (before this worker takes work), then watch it."""
        self.sync()
        thread = threading.Thread(target=self._watch, name="adapter-sync", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.sync()
            except redis.RedisError:
                pass  # looks again when Redis is back; what is loaded keeps serving
            except Exception:
                log.exception("adapter sync failed")
