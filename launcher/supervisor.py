"""Keeping ``rollout-queue up``'s children alive: a dead child is started again, with backoff.

One OOM kill or crash of a worker must not become a full outage, so a child that exits (for any
reason, any exit code) is started again after a pause that doubles with each quick death (a child
that keeps failing at start, e.g. a bad model, does not spin) and starts over once the child has
stayed up for :data:`STABLE_S`. Every death and every restart is logged. Only SIGTERM or SIGINT
to ``up`` stops the children, and then for good.

Hand-written rather than supervisord or systemd: ``up`` is the one-command, no-setup way to run
the service (a pip install, no system service manager); deployments that have one run the parts
separately (``rollout-queue api``, ``rollout-queue worker KIND``) under it instead.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import RolloutError

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
# A child that stayed up this long had a clean run: its next death restarts it quickly again.
STABLE_S = 60.0


def backoff(failures: int) -> float:
    """The pause before restart number ``failures`` (1, 2, ...) of quick deaths in a row."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** max(0, failures - 1))


@dataclass
class Child:
    """One supervised part: ``start()`` launches it; ``alive()`` and ``pid()`` report on it."""

    name: str
    start: Callable[[], object]
    alive: Callable[[], bool]
    pid: Callable[[], int | None]
    started_at: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    restarts: int = field(default=0)


class Supervisor:
    def __init__(self, children: list[Child]):
        self.children = children

    def start_all(self) -> None:
        """Start every child that is not already running (an embedded Redis started first is)."""
        for child in self.children:
            if not child.alive():
                self._launch(child)

    def tick(self, now: float | None = None) -> None:
        """Notice deaths, and restart what is due; call it often (every ~0.2 s)."""
        now = time.monotonic() if now is None else now
        for child in self.children:
            if child.restart_at is None:
                if child.alive():
                    continue
                child.failures = 1 if now - child.started_at >= STABLE_S else child.failures + 1
                delay = backoff(child.failures)
                child.restart_at = now + delay
                log.warning("child %s (pid %s) died; restarting it in %.1f s (restart %d)", child.name, child.pid(),
                            delay, child.restarts + 1)
            elif now >= child.restart_at:
                child.restarts += 1
                self._launch(child)

    def _launch(self, child: Child) -> None:
        child.restart_at = None
        child.started_at = time.monotonic()
        try:
            child.start()
        except (RolloutError, OSError) as exc:  # e.g. Redis could not start: try again later
            log.warning("child %s did not start: %s", child.name, getattr(exc, "message", None) or exc)
            return
        if child.restarts:
            log.warning("child %s restarted (pid %s)", child.name, child.pid())


def process_child(name: str, spawn: Callable[[], subprocess.Popen]) -> tuple[Child, Callable[[], subprocess.Popen | None]]:
    """A :class:`Child` for a subprocess made by ``spawn``, and a getter of its current process."""
    holder: dict[str, subprocess.Popen | None] = {"process": None}

    def start() -> None:
        holder["process"] = spawn()

    def alive() -> bool:
        process = holder["process"]
        return process is not None and process.poll() is None

    def pid() -> int | None:
        process = holder["process"]
        return process.pid if process is not None else None

    return Child(name, start, alive, pid), lambda: holder["process"]
