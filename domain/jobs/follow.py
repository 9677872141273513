"""Following jobs' event streams until they end: what every streamed view (SSE) iterates.

:func:`follow` reads the jobs it follows through the process's event hub (one XREAD for every
stream of the process), yields their events, a :class:`KeepAlive` when nothing came for
``keepalive`` seconds, and each job's :class:`Ended` (its final record, read once) after its
terminal status event. :class:`TokenLedger` is what a dialect
stream keeps to deliver each token once across a redo (see ``domain/jobs/events.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from domain.infra.store_errors import StoreUnavailable
from domain.jobs.event_hub import EventHub, Outage
from domain.jobs.events import JobEvent, JobEvents
from domain.jobs.store import TERMINAL, JobStore
from engine.choice import Choice
from engine.errors import Fault, RolloutError


class StreamDivergedError(RolloutError):
    """A redone job produced tokens other than those a dialect stream already delivered (its GPU
    worker died and sampling was not reproducible): the stream cannot go on truthfully."""

    code = "stream_diverged"
    fault = Fault.CONFLICT
    retryable = True


class StreamGapError(RolloutError):
    """The job's event stream lost entries this reader needs (trimmed past MAXLEN, or expired)."""

    code = "stream_incomplete"
    fault = Fault.GONE


@dataclass(frozen=True)
class KeepAlive:
    pass


@dataclass(frozen=True)
class Ended:
    job: dict[str, Any]


def follow(hub: EventHub, jobs: JobStore, positions: dict[str, str], *, keepalive: float, outage_s: float = 0.0,
           stored_results: bool = False) -> Iterator[tuple[str, JobEvent | Ended] | KeepAlive]:
    """Events of the jobs in ``positions`` (job id -> last entry id seen, ``"0"`` for all), each
    job's ``Ended`` after its terminal status, until every job ended. The reading is the process's
    :class:`~domain.jobs.event_hub.EventHub` (one XREAD for all its streams).

    Redis away for less than ``outage_s`` seconds (a blip, a failover) is ridden out: keep-alives
    while it is away, then the events from where the stream was, none lost or twice. A longer
    outage raises :class:`~domain.infra.store_errors.StoreUnavailable` (from Redis' error).

    ``stored_results``: each ``Ended`` job's result is left as stored (a ``StoredJSON``), for a
    reader that sends it on as it is.

    The jobs are marked as read first: their tokens are written only then (see job_events)."""
    positions = dict(positions)
    events = hub.events
    down_since: float | None = None
    subscription = None
    delivered = None  # entries the hub handed over, kept until their items are made
    try:
        while positions:
            try:
                if subscription is None:
                    events.watch(list(positions))
                    subscription = hub.subscribe(positions)
                got = delivered if delivered is not None else subscription.get(keepalive)
                if isinstance(got, Outage):
                    raise got.error
                if got is None:
                    items, moved = _ended_quietly(events, jobs, positions, stored_results)
                else:
                    delivered = got
                    items, moved = _items(jobs, positions, got, stored_results)
                    delivered = None
            except redis.RedisError as error:
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                if now - down_since >= outage_s:
                    raise StoreUnavailable("the job store is unavailable") from error
                yield KeepAlive()
                time.sleep(min(0.5, keepalive))
                continue
            down_since = None
            positions = moved
            for ended in [item[0] for item in items if isinstance(item, tuple) and isinstance(item[1], Ended)]:
                subscription.drop(ended)
            items.reverse()
            while items:  # handed over, not kept: an ended job's record is its reader's to drop
                yield items.pop()
    finally:
        if subscription is not None:
            subscription.close()


def _items(jobs: JobStore, positions: dict[str, str], batch: list[tuple[str, JobEvent]], stored: bool):
    """The items of the entries the hub delivered, and the positions past them (without the jobs
    that ended). ``positions`` itself is left as it was, so a read that fails halfway moves nothing."""
    positions = dict(positions)
    items: list = []
    for job_id, event in batch:
        if job_id not in positions:
            continue
        positions[job_id] = event.id
        items.append((job_id, event))
        if event.type == "status" and event.data.get("status") in TERMINAL:
            positions.pop(job_id)
            job = jobs.get_many([job_id], stored_result=stored)[0]
            items.append((job_id, Ended(job if job is not None else {"id": job_id, "status": event.data["status"]})))
    return items, positions


def _ended_quietly(events: JobEvents, jobs: JobStore, positions: dict[str, str], stored: bool):
    """Nothing came for a keep-alive period: a :class:`KeepAlive`, and the end of each job whose
    record ended while its stream says nothing (the stream trimmed, expired, or the job ended by a
    path that predates streams), after a last read of its stream; and the positions after them."""
    positions = dict(positions)
    items: list = [KeepAlive()]
    records = jobs.get_many(list(positions), stored_result=stored)
    ended = [(job_id, job) for job, job_id in zip(records, list(positions), strict=True)
             if job is not None and job["status"] in TERMINAL]
    for job_id, job in ended:
        for _, event in events.read({job_id: positions[job_id]}, block_ms=None):
            items.append((job_id, event))
        positions.pop(job_id)
        items.append((job_id, Ended(job)))
    return items, positions


class AttemptFilter:
    """Drops tokens of attempts older than the newest one seen (a dead worker's, see job_events)."""

    def __init__(self):
        self.attempt: dict[str, int] = {}

    def keep(self, job_id: str, event: JobEvent) -> bool:
        attempt = event.data.get("attempt")
        if event.type not in ("tokens", "restart") or attempt is None:
            return True
        newest = self.attempt.get(job_id, 0)
        if attempt < newest:
            return False
        self.attempt[job_id] = attempt
        return True


@dataclass
class ChoiceDelta:
    """What a stream sends next for one choice of one job."""

    job_id: str
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    def as_choice(self) -> Choice:
        """This delta as a choice of its own, for the mappers that spell tokens and logprobs."""
        return Choice(self.index, self.token_ids, self.logprobs, self.finish_reason or "", text=self.text)


@dataclass
class _Delivered:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    attempt_text: str = ""  # the text of the current attempt so far (compared with ``text``)


class TokenLedger:
    """What a dialect stream has delivered, per (job, choice): each token once, in order, across
    attempts. A later attempt's tokens at offsets already delivered must equal them (they are
    skipped); beyond, they are delivered. Anything else raises :class:`StreamDivergedError`."""

    def __init__(self):
        self.delivered: dict[tuple[str, int], _Delivered] = {}
        self._filter = AttemptFilter()

    def cumulative(self, job_id: str, index: int) -> _Delivered:
        return self.delivered.setdefault((job_id, index), _Delivered())

    def take(self, job_id: str, event: JobEvent) -> list[ChoiceDelta]:
        if not self._filter.keep(job_id, event):
            return []
        if event.type == "restart":
            for (job, _), seen in self.delivered.items():
                if job == job_id:
                    seen.attempt_text = ""
            return []
        if event.type != "tokens":
            return []
        return [self._take_choice(job_id, choice) for choice in event.data["choices"]]

    def _take_choice(self, job_id: str, choice: dict[str, Any]) -> ChoiceDelta:
        seen = self.cumulative(job_id, choice["index"])
        delta = ChoiceDelta(job_id, choice["index"], finish_reason=choice.get("finish_reason"))
        logprobs = choice.get("logprobs") or []
        for i, token in enumerate(choice["token_ids"]):
            at = choice["offset"] + i
            if at < len(seen.token_ids):
                if seen.token_ids[at] != token:
                    raise StreamDivergedError("the job was redone after a worker failure and generated other "
                                              "tokens than this stream already sent; read the job's result")
            elif at == len(seen.token_ids):
                seen.token_ids.append(token)
                delta.token_ids.append(token)
                if i < len(logprobs):
                    seen.logprobs.append(logprobs[i])
                    delta.logprobs.append(logprobs[i])
            else:
                raise StreamGapError("the job's event stream lost tokens this stream needs; read the job's result")
        seen.attempt_text += choice.get("text") or ""
        delta.text = self._new_text(seen)
        return delta

    @staticmethod
    def _new_text(seen: _Delivered) -> str:
        now, sent = seen.attempt_text, seen.text
        if len(now) <= len(sent):
            if not sent.startswith(now):
                raise StreamDivergedError("the redone job's text differs from what this stream sent")
            return ""
        if not now.startswith(sent):
            raise StreamDivergedError("the redone job's text differs from what this stream sent")
        seen.text = now
        return now[len(sent):]

    def forget(self, job_id: str) -> None:
        """Drop what was delivered of an ended job (as many tokens and logprobs as its result)."""
        for key in [key for key in self.delivered if key[0] == job_id]:
            del self.delivered[key]

    def finish(self, job_id: str, choices: list[Choice]) -> list[ChoiceDelta]:
        """The rest of each choice from the job's result: normally nothing but its finish reason;
        the stream then ends with exactly the result's tokens and text."""
        out = []
        for choice in choices:
            seen = self.cumulative(job_id, choice.index)
            ids = choice.token_ids
            if ids[:len(seen.token_ids)] != seen.token_ids:
                raise StreamDivergedError("the job's result differs from the tokens this stream sent")
            rest = ids[len(seen.token_ids):]
            logprobs = (choice.logprobs or [])[len(seen.logprobs):]
            seen.token_ids += rest
            seen.logprobs += logprobs
            text = choice.text or ""
            if not text.startswith(seen.text):
                raise StreamDivergedError("the job's result text differs from the text this stream sent")
            tail, seen.text = text[len(seen.text):], text
            out.append(ChoiceDelta(job_id, choice.index, rest, logprobs, tail, choice.finish_reason))
        return out
