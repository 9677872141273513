"""Loading and unloading an adapter for the fleet: the registry changed, then a wait until every
live GPU worker has applied it (``workers/gpu/adapter_sync.py`` reports each epoch it applied).

The API cannot check an adapter against the base (it loads no model): each GPU worker checks it
before it serves it (engine/lora/adapter_files.py). When every live worker refused it, the entry
is put back to what it was, so a refusal changes nothing that is served, and the workers' error
(``adapter_invalid`` with its problem) is the call's. With no live worker the entry stands: each
worker loads the set when it starts.
"""

from __future__ import annotations

import time

from domain.adapters.store import AdapterEntry, AdapterRegistry, WorkerAdapters
from engine.errors import Fault, RolloutError
from engine.lora.errors import AdapterLimitError, AdapterNotFoundError

POLL_SECONDS = 0.05


class AdapterExistsError(RolloutError):
    """An adapter of that name is loaded already and the call did not ask ``load_inplace``."""

    code = "adapter_exists"
    fault = Fault.CONFLICT


class AdapterNotLoadedError(RolloutError):
    """Not every live GPU worker applied the change in time."""

    code = "adapter_not_loaded"
    fault = Fault.DEADLINE_EXCEEDED
    retryable = True


def load(registry: AdapterRegistry, *, scope: str, name: str, path: str, inplace: bool, per_key_cap: int | None,
         timeout: float, mode: str = "finish", recompute_kv: bool = False) -> AdapterEntry:
    """Make ``path`` the adapter ``name`` of ``scope`` (a new version when ``inplace`` and loaded
    already: the old version's rows finish on it, with ``mode`` abort end now, with keep go on under
    the new one); answers once every live GPU worker serves it. ``per_key_cap``: None for shared."""
    current = registry.get(scope, name)
    if current is not None and not inplace:
        raise AdapterExistsError(f"adapter {name!r} is loaded already; pass load_inplace to replace it",
                                 errors={"lora_name": name})
    if current is None and per_key_cap is not None and registry.count(scope) >= per_key_cap:
        raise AdapterLimitError(f"this key has {per_key_cap} adapters loaded (ROLLOUT_MAX_LORAS_PER_KEY); unload "
                                "one first", errors={"limit": per_key_cap})
    entry, previous, epoch = registry.put(scope=scope, name=name, path=path, mode=mode,
                                          recompute_kv=recompute_kv)
    workers = wait_for_fleet(registry, epoch, timeout)
    refusals = [w.refused[entry.id] for w in workers if entry.id in w.refused]
    if workers and len(refusals) == len(workers):
        registry.put_back(entry, previous)
        raise RolloutError.from_record(refusals[0])
    late = [w.worker for w in workers if w.epoch < epoch or entry.id in w.refused]
    if late:  # some serve it, some do not (yet): the per-worker report says which
        raise AdapterNotLoadedError(f"{len(late)} of {len(workers)} GPU workers do not serve adapter {name!r}",
                                    errors={"workers": late, "refused": {w.worker: w.refused[entry.id]
                                                                         for w in workers if entry.id in w.refused}})
    return entry


def unload(registry: AdapterRegistry, *, scope: str, name: str, timeout: float) -> AdapterEntry:
    """Remove ``name`` of ``scope``: from now on a request naming it is a 404; each GPU worker lets
    the rows running under it finish."""
    entry = registry.remove(scope, name)
    if entry is None:
        raise AdapterNotFoundError(f"adapter {name!r} is not loaded", errors={"lora_name": name})
    wait_for_fleet(registry, registry.epoch(), timeout)
    return entry


def wait_for_fleet(registry: AdapterRegistry, epoch: int, timeout: float) -> list[WorkerAdapters]:
    """The live GPU workers' reports once each applied ``epoch`` (or at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = registry.workers()
        if all(w.epoch >= epoch for w in workers) or time.monotonic() >= deadline:
            return workers
        time.sleep(POLL_SECONDS)
