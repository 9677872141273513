"""When a GPU worker last made progress, for its heartbeat (``progress_at``): ``/healthz`` names a
worker that holds messages and has not moved for ``ROLLOUT_STALLED_JOB_AFTER`` seconds (issue #56:
a GPU worker held its jobs for minutes, wrote nothing, and its heartbeat said all was well).

Progress is read from what the worker already keeps, at each beat, so the decode loop pays nothing:
the engine's forwards (a decode step, a prompt's prefill) and the messages it held at the last
beat and holds no more (their jobs ended, or went back). A worker that holds nothing is idle, not
stalled: its clock starts again when it takes a message.
"""

from __future__ import annotations

import time


class ProgressStamp:
    def __init__(self, clock=time.time):
        self.clock = clock
        self.at = clock()
        self._forwards = -1
        self._held: set[str] = set()

    def observe(self, forwards: int, held: list[str]) -> float:
        """The time of the last progress, given the engine's forwards so far and the tags held now."""
        now_held = set(held)
        if not now_held or forwards != self._forwards or self._held - now_held:
            self.at = self.clock()
        self._forwards, self._held = forwards, now_held
        return self.at
