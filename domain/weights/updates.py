"""Updating the fleet's weights: set the target, wait until every live GPU worker serves it.

Called by the API (``POST /v1/weights`` and SGLang's ``/update_weights_from_disk``); the workers'
side is :mod:`workers.gpu.weight_sync`. "Live" means a worker whose record in the store has not
expired: one that dies during the update drops out within ``WORKER_TTL`` seconds, and loads the
target when it comes back, before it takes work.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import redis

from domain.weights.store import Pause, WeightStore, WeightTarget, WorkerWeights
from engine.errors import Fault, InvalidRequestError, RolloutError

POLL_SECONDS = 0.1


class WeightsRefusedError(InvalidRequestError):
    """Every live GPU worker refused the new weights; the last served target was put back."""

    code = "weights_refused"


class WeightsSupersededError(RolloutError):
    """A newer update set its target while this one's was loading: the fleet moved on."""

    code = "weights_superseded"
    fault = Fault.CONFLICT


class WeightsNotLoadedError(RolloutError):
    """Not every live GPU worker serves the new weights (time out, or some failed to load)."""

    code = "weights_not_loaded"
    fault = Fault.DEADLINE_EXCEEDED
    retryable = True


@dataclass(frozen=True)
class UpdateReport:
    target: WeightTarget
    workers: list[WorkerWeights]
    num_paused_requests: int

    @property
    def serving(self) -> list[WorkerWeights]:
        return [w for w in self.workers if _serves(w, self.target)]

    def to_dict(self) -> dict:
        return {"success": True, "message": _summary(self), "num_paused_requests": self.num_paused_requests,
                "weight_version": self.target.version, "target": asdict(self.target),
                "workers": [asdict(w) for w in self.workers]}


def update_weights(store: WeightStore, *, version: str, model_path: str, mode: str, timeout: float,
                   recompute_kv: bool = False) -> UpdateReport:
    """Set the target and wait up to ``timeout`` seconds for every live GPU worker to serve it.

    Raises :class:`WeightsRefusedError` (target put back) when every live worker failed to load it,
    :class:`WeightsNotLoadedError` with the per-worker report when some did not serve it in time."""
    target = store.set_target(version=version, model_path=model_path, mode=mode, recompute_kv=recompute_kv)
    workers = wait_for_fleet(store, target, timeout)
    failed = [w for w in workers if w.target_id == target.id and w.state == "failed"]
    if workers and len(failed) == len(workers):
        store.put_back(target.id, failed)  # the workers do it too, by their own reports
    if (refusals := store.refusals(target.id)) is not None:  # put back, by this call or by the workers
        first = (refusals[0].error if refusals else None) or {}
        raise WeightsRefusedError(f"no GPU worker could load the weights: {first.get('message', 'unknown error')}",
                                  errors={"workers": [asdict(w) for w in refusals], **(first.get("errors") or {})})
    current = store.target()
    if current is not None and current.id != target.id and current.set_at > target.set_at:
        raise WeightsSupersededError(f"weights {current.version} were set while these were loading",
                                     errors={"target": asdict(current)})
    report = UpdateReport(target, workers, sum(w.interrupted for w in workers if w.target_id == target.id))
    if len(report.serving) < len(workers):
        raise WeightsNotLoadedError(_summary(report), errors=report.to_dict() | {"success": False})
    return report


def wait_for_fleet(store: WeightStore, target: WeightTarget, timeout: float) -> list[WorkerWeights]:
    """The live workers' records once each serves ``target`` or failed it, once ``target`` is no
    longer the fleet's (put back, or a newer one set), or at ``timeout``. Redis going away
    meanwhile is waited out (until the timeout)."""
    deadline = time.monotonic() + timeout
    workers: list[WorkerWeights] = []
    while True:
        try:
            workers = store.workers()
            current = store.target()
        except redis.RedisError:
            pass
        else:
            if all(_serves(w, target) or (w.target_id == target.id and w.state == "failed") for w in workers):
                return workers
            if current is None or current.id != target.id:
                return workers
        if time.monotonic() >= deadline:
            return workers
        time.sleep(POLL_SECONDS)


def fleet_paused(store: WeightStore, pause: Pause, timeout: float) -> list[WorkerWeights]:
    """The live workers' records once each has seen ``pause`` (not an earlier one: its count of
    stopped rows is this pause's), or at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        workers = store.workers()
        if all(w.pause_id == pause.id for w in workers) or time.monotonic() >= deadline:
            return workers
        time.sleep(POLL_SECONDS)


def _serves(worker: WorkerWeights, target: WeightTarget) -> bool:
    return worker.target_id == target.id and worker.state == "serving" and worker.version == target.version


def _summary(report: UpdateReport) -> str:
    total, serving = len(report.workers), len(report.serving)
    if not total:
        return f"weights {report.target.version} set; no live GPU worker (each loads them when it starts)"
    if serving == total:
        return f"all {total} GPU workers serve weights {report.target.version}"
    return f"{serving} of {total} GPU workers serve weights {report.target.version}"
