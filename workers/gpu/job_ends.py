"""How a GPU session ends the jobs a step finished, and what it does when Redis refuses the writes
for memory (``noeviction`` at its ``maxmemory``).

A job's end (its result, ``domain/lifecycle.py``) is written in one round trip for the step, after
its tokens; its prompt is released and its message acknowledged once the end is stored. A job a
weight update retracted gives its attempt up and goes back to the queue (one the scheduler preempts
stays in it and resumes: ``engine/preemption.py``).

At Redis' bound those writes are refused. None of that is the job's fault, so none fails for it:

- the ends are held in memory (:class:`HeldEnds`), their messages unacknowledged, and written
  again, tokens first, with a backoff, until Redis has room (results expire meanwhile: README,
  "Sizing Redis memory"). While ends are held the session takes no new work, so what it holds is
  bounded by the rows already running;
- after ``GIVE_UP_SECONDS`` the held jobs go back to the queue unfailed (their messages given back,
  ``GenerateBatches.hand_back``) and run again from their prompts; so do they when the session
  ends on an unexpected error meanwhile (``workers/tasks/gpu.py``);
- a job whose requeue is refused has its own message given back instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from domain.jobs.attempts import FENCED
from domain.jobs.prompt_codec import release_prompts
from domain.lifecycle import end_fenced
from workers.gpu.jobs import requeue_generate
from workers.memory_refusal import refused_for_memory

log = logging.getLogger(__name__)

FIRST_BACKOFF_SECONDS = 0.1
MAX_BACKOFF_SECONDS = 2.0
# How long a session holds ends Redis refuses before it hands their jobs back to the queue.
GIVE_UP_SECONDS = 300.0


@dataclass
class HeldEnds:
    """Ends Redis refused for memory: ``(live, (job, status, fields))`` pairs, and when to try again."""

    items: list[tuple[Any, tuple]] = field(default_factory=list)
    since: float = 0.0
    retry_at: float = 0.0
    backoff: float = FIRST_BACKOFF_SECONDS

    def hold(self, items: list[tuple[Any, tuple]]) -> None:
        """Hold ``items`` after a refusal: the first since the last write that went through starts
        the clock (``since``); a retry refused again doubles the backoff. ``take`` empties the
        items for a retry, so the clock is kept apart from them."""
        now = time.monotonic()
        if not self.since:
            self.since, self.backoff = now, FIRST_BACKOFF_SECONDS
        else:
            self.backoff = min(self.backoff * 2, MAX_BACKOFF_SECONDS)
        self.items = items
        self.retry_at = now + self.backoff

    def take(self) -> list[tuple[Any, tuple]]:
        items, self.items = self.items, []
        return items

    def written(self) -> None:
        """The ends went through (or were handed back): the next refusal starts a new clock."""
        self.since = 0.0

    @property
    def due(self) -> bool:
        return bool(self.items) and time.monotonic() >= self.retry_at

    @property
    def expired(self) -> bool:
        return bool(self.items) and time.monotonic() - self.since >= GIVE_UP_SECONDS

    def wait(self) -> None:
        """Sleep until the next try."""
        time.sleep(max(0.0, self.retry_at - time.monotonic()))


class JobEnds:
    """A session's job ends: ``batches`` settles its messages, ``metrics`` counts the ends and
    ``flush_tokens`` writes the tokens staged so far (raising what Redis raised)."""

    def __init__(self, rt, batches, *, metrics, flush_tokens):
        self.rt, self.batches, self.metrics, self.flush_tokens = rt, batches, metrics, flush_tokens
        self.held = HeldEnds()

    @property
    def holding(self) -> bool:
        return bool(self.held.items)

    def finish(self, ended: list, endings: list[tuple], retracted: list, superseded: list) -> None:
        """End ``ended`` with ``endings``, send ``retracted`` back to the queue, settle ``superseded``."""
        rt, batches = self.rt, self.batches
        done, fenced = self._write(list(zip(ended, endings, strict=True)))
        requeued, handed_back = self._requeue(retracted)
        # A superseded attempt's message is settled too: the newer attempt's worker holds its copy.
        batches.acknowledge([mid for live in (*done, *fenced, *requeued, *superseded) for mid in live.message_ids])
        if handed_back:
            batches.hand_back([mid for live in handed_back for mid in live.message_ids])
        interrupted = sum(live.stopped_by is not None for live in (*done, *retracted))
        if interrupted:
            rt.weight_sync.note_interrupted(interrupted)

    def retry(self) -> None:
        """Write the held ends again (when due); hand their jobs back once held too long."""
        if self.held.expired:
            count = self.hand_back_held()
            log.warning("Redis refused %d job ends for %.0f s; their jobs go back to the queue", count,
                        GIVE_UP_SECONDS)
        elif self.held.due:
            done, fenced = self._write([])
            self.batches.acknowledge([mid for live in (*done, *fenced) for mid in live.message_ids])

    def hand_back_held(self) -> int:
        """The held ends' jobs go back to the queue unfailed, their prompts kept: their messages
        given back rather than settled. How many."""
        items = self.held.take()
        self.held.written()
        if items:
            self.batches.hand_back([mid for live, _ in items for mid in live.message_ids])
        return len(items)

    def _write(self, items: list[tuple[Any, tuple]]) -> tuple[list, list]:
        """Write the ends (the held ones first), their tokens before them: the lives ended, and
        those a newer attempt superseded (they wrote nothing). What Redis refuses for memory is
        held, nothing of it acknowledged."""
        rt = self.rt
        items = self.held.take() + items
        if not items:
            return [], []
        lives = [live for live, _ in items]
        try:
            self.flush_tokens()  # a stream's tokens precede its end
            outcomes = end_fenced(rt, [ending for _, ending in items], [live.fence for live in lives],
                                  metrics=self.metrics)
        except Exception as error:
            if not refused_for_memory(rt.redis, error):
                # Kept for the task's catch-all to hand back (workers/tasks/gpu.py): taken above,
                # they would leave with the error, their jobs generating until the reaper. A
                # script's refusal read when memory has just fallen below the mark lands here.
                self.held.items = items
                raise
            if not self.held.since:
                log.warning("Redis is at its maxmemory: %d job ends held, written again when it has room",
                            len(items))
            self.held.hold(items)
            return [], []
        self.held.written()
        done, superseded = [], []
        for (live, (_, status, fields)), outcome in zip(items, outcomes, strict=True):
            if outcome == FENCED:
                live.superseded = True
                superseded.append(live)
                continue
            done.append(live)
            if status == "failed" and outcome == 1:
                log.info("job %s failed: %s", live.job.id, fields["error"]["code"])
        if superseded:
            log.warning("%d superseded attempts dropped: %s", len(superseded),
                        ", ".join(f"{live.job.id}#{live.attempt}" for live in superseded))
        release_prompts(rt.redis, [live.prompt for live in done])
        return done, superseded

    def _requeue(self, retracted: list) -> tuple[list, list]:
        """Give each attempt up and queue its job again: the lives whose message is settled, and
        those whose message goes back instead (Redis refused the requeue for memory)."""
        rt = self.rt
        if not retracted:
            return [], []
        try:
            released = rt.events.release_attempts([(live.job.id, live.attempt) for live in retracted])
        except Exception as error:
            if not refused_for_memory(rt.redis, error):
                raise
            return [], retracted
        settled, handed_back = [], []
        for live, still_newest in zip(retracted, released, strict=True):
            if still_newest:
                try:
                    requeue_generate(rt, live.job, live.prompt)
                except Exception as error:
                    if not refused_for_memory(rt.redis, error):
                        raise
                    handed_back.append(live)
                    continue
            settled.append(live)
        return settled, handed_back
