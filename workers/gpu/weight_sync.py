"""A GPU worker's side of weight updates: serve the fleet's target, or take no work.

The batch loop uses :class:`WeightSync` in two places, and nothing else changes:

- around each batch, ``with sync.batch(hold_seconds) as may_serve:``: if the target differs from
  the weights this worker serves, it loads them first (in the batch thread, between batches, so no
  batch ever sees half-copied weights); ``may_serve`` is False while the worker must not generate
  (the target failed to load here, or generation is paused): the batch then hands its messages back
  to the queue (unless it holds rows for mode ``keep``: they wait for the pause's end). A swap never
  lands inside a stretch of decode steps: the watcher loads only while no stretch holds the lock,
  and each row records the version of every token it makes (engine/row_versions.py).
- between decode steps, :meth:`WeightSync.interruption` says whether rows in flight must stop now
  (``"abort"`` or ``"retract"``) for a pending update or a pause; ``None`` lets them finish, unless
  :attr:`WeightSync.holds_rows` (mode ``keep``, or a pause in mode ``keep`` / ``in_place``): the
  session then leaves the stretch with its rows still in the scheduler, the next ``batch`` loads the
  target, and the rows go on under it (``Scheduler.weights_changed``), or hold still while paused.

A watcher thread reads the target every ``poll_seconds`` (so ``interruption`` costs no Redis call
per step), loads it when the worker is idle (an idle worker must converge too), and refreshes this
worker's record in the store (its TTL is what makes the worker "live").

A worker that fails to load a target keeps its old weights, reports the error and takes no work
until a newer target (or the previous one, put back) arrives: no half-loaded model ever serves,
and no job runs on weights the fleet has moved away from.

A version is bound to its content (``WeightTarget.digest``), so a directory overwritten in place
(RL trainers often write ``latest/``) or pruned no longer serves it. Each node therefore keeps a
copy of the weights it served (``<state dir>/weights-kept/<digest>``, written by the first worker
of the node to load them, from the loaded model itself, so it holds exactly what was served): a
worker that restarts loads the version from the copy when the directory no longer holds it, the
copy checked against the digest like any load. The two newest copies are kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import redis

from domain.weights.paths import resolve_weights_dir
from domain.weights.store import Pause, WeightStore, WeightTarget, WorkerWeights
from engine.errors import RolloutError

log = logging.getLogger(__name__)

INTERRUPTING_MODES = ("abort", "retract")
HOLDING_MODES = ("keep", "in_place")  # rows hold still and go on after the swap or the pause
KEPT_COPIES = 2  # the weights served now and the ones before (an update may still be put back)


class WeightSync:
    def __init__(self, store: WeightStore, engine, *, worker: str, node: str, weights_root: Path | None,
                 kept_root: Path | None = None, poll_seconds: float = 0.2):
        self.store = store
        self.engine = engine  # an engine.generation.Engine (update_weights, save_weights, weight_version)
        self.worker = worker
        self.node = node
        self.weights_root = weights_root
        self.kept_root = kept_root  # this node's copies of served weights, by digest; None: none kept
        self.poll_seconds = poll_seconds
        # Held by a running batch and by a load: a load waits for the batch and the batch for the load.
        self._lock = threading.RLock()
        self._changed = threading.Event()  # the watcher saw a new target or pause state
        self._known = False  # the target was read at least once
        self._target: WeightTarget | None = None
        self._pause: Pause | None = None
        self._served_id: str | None = None  # the target whose weights are loaded (None: the start-up model)
        self._tried_id: str | None = None  # the target last tried, loaded or not
        self._loading = False
        self._error: dict | None = None  # why the target last tried did not load
        self._interrupted = 0
        self._interrupted_for: str | None = None  # the target (or pause) the count belongs to
        self._held_for: str | None = None  # the scope whose held rows were counted
        self.recompute_kv = False  # the last target loaded asked its kept rows' KV computed again
        self._stop = threading.Event()
        self.keeping: threading.Thread | None = None  # the copy of the last weights loaded, being written

    # --- used by the batch loop -------------------------------------------------------------------

    @contextmanager
    def batch(self, hold_seconds: float = 0.0) -> Iterator[bool]:
        """Hold the weights still for one batch; yields whether this worker may generate now.

        Loads a pending target first. While the worker may not serve, waits up to ``hold_seconds``
        for that to change (a pause ending, a new target) before yielding False. Raises
        ``redis.RedisError`` when the target cannot be read (the caller requeues the batch)."""
        deadline = time.monotonic() + hold_seconds
        while True:
            self._lock.acquire()
            try:
                ready = self.poll()
            except BaseException:
                self._lock.release()
                raise
            if ready:
                break
            self._lock.release()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                yield False
                return
            self._changed.wait(min(remaining, self.poll_seconds))
            self._changed.clear()
        try:
            yield True
        finally:
            self._lock.release()

    def poll(self) -> bool:
        """Read the target; load it if this worker has not tried it yet. True when this worker
        may generate now. Call between batches (it takes the batch lock)."""
        with self._lock:
            self._refresh()
            target = self._target
            if target is not None and target.id not in (self._served_id, self._tried_id):
                self._load(target)
            return self.may_serve

    @property
    def may_serve(self) -> bool:
        return self._pause is None and self.state == "serving"

    @property
    def state(self) -> str:
        """starting | loading | serving | failed (see domain.weights.store.STATES)."""
        if not self._known:
            return "starting"
        if self._loading:
            return "loading"
        target = self._target
        if target is None or target.id == self._served_id:
            return "serving"  # no target yet: the start-up weights are the fleet's
        return "failed" if target.id == self._tried_id else "loading"

    def interruption(self) -> str | None:
        """``"abort"`` or ``"retract"`` when rows in flight must stop now, else None."""
        if self._pause is not None and self._pause.mode in INTERRUPTING_MODES:
            return self._pause.mode
        target = self._target
        if (target is not None and target.mode in INTERRUPTING_MODES
                and target.id not in (self._served_id, self._tried_id)):
            return target.mode
        return None

    @property
    def holds_rows(self) -> bool:
        """Rows in flight must hold still where they are (a pending target in mode keep, or a
        pause in mode keep / in_place), to go on after the swap or the pause."""
        pause, target = self._pause, self._target
        if pause is not None and pause.mode in HOLDING_MODES:
            return True
        return (target is not None and target.mode in HOLDING_MODES
                and target.id not in (self._served_id, self._tried_id))

    def note_held(self, rows: int) -> None:
        """Count once the rows held still for the current update or pause."""
        if self._interrupted_for is not None and self._held_for != self._interrupted_for:
            self._held_for = self._interrupted_for
            self.note_interrupted(rows)

    @property
    def update_pending(self) -> bool:
        """A target this worker has not tried yet, or a pause: new rows must wait (the rows in
        flight finish, or stop for ``interruption``), then the next stretch loads or holds."""
        target = self._target
        return self._pause is not None or (target is not None and target.id not in (self._served_id, self._tried_id))

    def note_interrupted(self, rows: int) -> None:
        """Count rows a batch stopped for the current update or pause (SGLang's num_paused_requests)."""
        self._interrupted += rows
        self._report_quietly()

    # --- start-up and the watcher -----------------------------------------------------------------

    def start(self) -> threading.Thread:
        """Load the current target now (before the worker takes work), then watch for new ones."""
        try:
            self.poll()
        except redis.RedisError:
            log.warning("weights target unreadable at start (Redis away); the first batch reads it")
        self._report_quietly()
        thread = threading.Thread(target=self._watch, name="weight-sync", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self._refresh()
                if self._lock.acquire(blocking=False):  # idle: converge now; busy: the next batch does
                    try:
                        self.poll()
                    finally:
                        self._lock.release()
                self._report()
                self._put_back_if_refused()
            except redis.RedisError:
                pass  # Redis is away: keep serving what is loaded, look again shortly
            except Exception:
                log.exception("weight sync watcher")
            self._stop.wait(self.poll_seconds)

    # --- internals --------------------------------------------------------------------------------

    def _refresh(self) -> None:
        target, pause = self.store.read()
        changed = (target.id if target else None) != (self._target.id if self._target else None) or pause != self._pause
        scope = target.id if target and target.id not in (self._served_id, self._tried_id) else None
        if pause is not None:
            scope = f"pause:{pause.id}"
        if scope is not None and scope != self._interrupted_for:
            self._interrupted_for, self._interrupted = scope, 0
        self._target, self._pause = target, pause
        self._known = True
        if changed:
            self._changed.set()

    def _load(self, target: WeightTarget) -> None:
        self._loading = True
        self._report_quietly()
        started = time.perf_counter()
        try:
            try:
                directory = resolve_weights_dir(target.model_path, self.weights_root)
                # The first worker to load a target binds what it read; every later load must read the same.
                swap = self.engine.update_weights(
                    directory, weight_version=target.version, root=self.weights_root,
                    digest_for=lambda found: target.digest or self._bind_digest(target, found))
            except RolloutError as error:
                if (kept := self._kept_copy(target)) is None:
                    raise
                log.warning("weights %s: %s; serving them from this node's copy", target.version, error.message)
                swap = self.engine.update_weights(kept, weight_version=target.version, root=self.kept_root,
                                                  digest_for=lambda found: target.digest)
            target = replace(target, digest=swap.digest)
            # Off the load path: the copy is as large as the model. It reads the parameters while
            # the worker serves; a later swap under it makes a copy whose digest check refuses it.
            self.keeping = threading.Thread(target=self._keep_copy, args=(target,), name="weights-copy", daemon=True)
            self.keeping.start()
        except RolloutError as error:
            self._fail(target, {"code": error.code, "message": error.message, **(
                {"errors": error.errors} if error.errors is not None else {})})
        except Exception:
            log.exception("weights %s failed to load", target.version)
            self._fail(target, {"code": "internal_error", "message": "internal error while loading the weights"})
        else:
            self._served_id = self._tried_id = target.id
            self.recompute_kv = target.recompute_kv
            self._error = None
            self._quietly(self.store.mark_served, target)
            log.info("serving weights %s (loaded in %.2f s)", target.version, time.perf_counter() - started)
        finally:
            self._loading = False
        self._report_quietly()
        self._changed.set()

    def _fail(self, target: WeightTarget, error: dict) -> None:
        self._tried_id = target.id
        self._error = error
        log.warning("weights %s not loaded (%s); old weights kept, no work taken", target.version, error["code"])

    def _put_back_if_refused(self) -> None:
        """A target every live worker refused goes back to the last served one, by the workers'
        own reports: it must not wait for the update call, which may have stopped waiting (a
        ``timeout_s`` of 0, an API that died), or the whole fleet would take no work."""
        target = self._target
        if target is None or self.state != "failed":
            return
        if (refusals := self.store.refused_everywhere(target.id)) is not None:
            if self.store.put_back(target.id, refusals):
                log.warning("weights %s were refused by every GPU worker: the last served target is back",
                            target.version)
                self._changed.set()

    @staticmethod
    def _quietly(call, *args) -> None:
        try:
            call(*args)
        except redis.RedisError:
            pass  # Redis is away: a later load or report writes it again

    def record(self) -> WorkerWeights:
        state = self.state
        return WorkerWeights(worker=self.worker, node=self.node, state=state,
                             version=self.engine.weight_version, target_id=self._tried_id,
                             paused=self._pause is not None, pause_id=self._pause.id if self._pause else None,
                             error=self._error if state == "failed" else None,
                             interrupted=self._interrupted)

    def _kept_copy(self, target: WeightTarget) -> Path | None:
        if self.kept_root is None or not target.digest:
            return None
        copy = self.kept_root / target.digest
        return copy if copy.is_dir() else None

    def _keep_copy(self, target: WeightTarget) -> None:
        """This node's copy of the weights just loaded, unless it has one; the two newest stay."""
        if self.kept_root is None or (self.kept_root / target.digest).is_dir():
            return
        partial = None
        try:
            self.kept_root.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=self.kept_root))
            self.engine.save_weights(partial)
            os.rename(partial, self.kept_root / target.digest)  # whole or not at all
        except Exception as error:  # another worker of the node kept it first, a full disk, ...
            if partial is not None:
                shutil.rmtree(partial, ignore_errors=True)
            if not (self.kept_root / target.digest).is_dir():  # the copy is a fallback: the load stands
                log.warning("weights %s: no copy kept on this node (%r)", target.version, error)
            return
        copies = sorted((p for p in self.kept_root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        for old in copies[KEPT_COPIES:]:
            shutil.rmtree(old, ignore_errors=True)

    def _bind_digest(self, target: WeightTarget, digest: str) -> str | None:
        try:
            return self.store.bind_digest(target.id, digest)
        except redis.RedisError:
            return None  # Redis is away: the next worker to load the target binds it

    def _report(self) -> None:
        self.store.report(self.record())

    def _report_quietly(self) -> None:
        try:
            self._report()
        except redis.RedisError:
            pass  # the watcher reports again when Redis is back
