"""Job records in Redis.

A job is a hash ``rq:job:<id>``. Its status only moves forward
(queued → preprocessing → generating → succeeded | failed | cancelled); the move is one Lua
script, so two workers racing on a redelivered message cannot move a job backwards or end it
twice. Only the call that actually ends a job gets ``True`` back, and only that call may fire the
job's webhook.

Per-owner indexes: ``rq:jobs:<owner>`` (sorted by creation, for listing) and an active-job counter
per owner and in total (for backpressure), kept exact by the same scripts. ``rq:unfinished`` holds
every unfinished job scored by its last move, for the sweep that finds jobs no message carries
(``domain/jobs/reaper.py``). ``rq:webhook:owed`` gets every job whose end owes a webhook, in the
script that ends it: a failover that keeps the end keeps the debt too (Redis replicates a script
as one write), and the webhook reaper (``domain/webhooks/reaper.py``) pays a debt whose
``job_ended`` message was lost. ``rq:batch:uncounted`` the same way gets every ended job of a batch
until its line is counted; the batch reaper (``domain/batches/reaper.py``) counts the ones a crash
or a failover left behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from domain.infra import redis_reservations, wakeups
from domain.infra.pipelined_scripts import run_scripts
from domain.infra.redis_records import decode_record, encode_field, new_id, page_by_creation, plausible_id
from domain.jobs import keys, scripts
from domain.jobs.attempts import Fence, preprocess_key
from domain.jobs.events import DEFAULT_MAXLEN, events_key, watch_key
from domain.jobs.keys import TOTAL_ACTIVE_KEY, UNCOUNTED_LINES_KEY, UNFINISHED_KEY, WEBHOOK_OWED_KEY
from domain.jobs.results import readable_result
from domain.jobs.stored_job import StoredJob
from engine.errors import NotFoundError, RateLimitedError, RolloutError

STATUSES = ("queued", "preprocessing", "generating", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
_RANK = {status: rank for rank, status in enumerate(STATUSES[:3])} | {s: 3 for s in TERMINAL}
_JSON_FIELDS = ("request", "result", "error", "webhook", "metadata", "timings")
_OWN_JSON_FIELDS = ("result", "timings")  # the service's own numbers only (decode_record)
_OTHER: dict[str, Any] = {}  # a listed job of another status than the one asked (JobStore._with_status)
# What a listing reads of each job (domain/jobs/view.listed_job): never the request or the result,
# which may be tens of MB (GET /v1/jobs?limit=1 took 2 s to list a job with a 16.8 MB result).
SUMMARY_FIELDS = ("id", "kind", "status", "created_at", "started_at", "completed_at", "request_id", "metadata",
                  "error", "batch_id", "custom_id")

class QueueFullError(RateLimitedError):
    code = "queue_full"


@dataclass(frozen=True)
class StoreLimits:
    max_active_per_owner: int
    max_active_total: int
    result_ttl: int
    events_maxlen: int = DEFAULT_MAXLEN


@dataclass(frozen=True)
class NewJob:
    """A job to create (``JobStore.add``, ``JobStore.create_many``): ``JobStore.create``'s arguments."""

    owner: str
    kind: str
    request: dict[str, Any]
    request_id: str | None = None
    webhook: dict | None = None
    metadata: dict | None = None
    extra: dict[str, str] | None = None
    prompt: str | None = None
    watched: bool = False
    job_id: str | None = None  # one made beforehand (its result reserved under it, web/api/submit.py); else new


class JobStore:
    """``hooked_owners``: the owners with a key-wide webhook (``ROLLOUT_KEY_WEBHOOKS``), whose every
    job's end owes one."""

    def __init__(self, client: redis.Redis, limits: StoreLimits, *, hooked_owners: frozenset[str] = frozenset(),
                 wait_any: wakeups.WaitAny | None = None):
        self.redis = client
        self.limits = limits
        self.hooked_owners = hooked_owners
        self.wait_any_wakeup = wait_any or wakeups.waiting_on(client)
        self._create = client.register_script(scripts.CREATE)
        self._transition = client.register_script(scripts.TRANSITION)
        self._ended_places = client.register_script(scripts.ENDED)
        self._claim_preprocessing = client.register_script(scripts.CLAIM_PREPROCESSING)
        self._save_prompt = client.register_script(scripts.SAVE_PROMPT)

    key = staticmethod(keys.job_key)
    prompt_key = staticmethod(keys.prompt_key)
    cancel_key = staticmethod(keys.cancel_key)
    done_key = staticmethod(keys.done_key)
    _active_key = staticmethod(keys.active_key)

    def create(self, *, owner: str, kind: str, request: dict[str, Any], request_id: str | None,
               webhook: dict | None = None, metadata: dict | None = None,
               extra: dict[str, str] | None = None, prompt: str | None = None, watched: bool = False) -> dict[str, Any]:
        """Store a new queued job and return its record. ``prompt``, a finalized prompt as JSON, is
        stored with it (under ``prompt_key``) when the job needs no preprocessing; ``watched``: a
        reader follows its events from the start (its tokens are written, see job_events).
        QueueFullError past a cap on unfinished jobs."""
        return self.add(NewJob(owner=owner, kind=kind, request=request, request_id=request_id, webhook=webhook,
                               metadata=metadata, extra=extra, prompt=prompt, watched=watched))

    def add(self, new: NewJob) -> dict[str, Any]:
        """``create`` of a :class:`NewJob`."""
        names, args, encoded = self._create_call(new)
        return self._created(self._create(keys=names, args=args), encoded)

    def create_many(self, jobs: list[NewJob]) -> list[dict[str, Any] | QueueFullError]:
        """``create`` for many jobs in one round trip: each one's record, or the QueueFullError it
        met (the caps are checked job by job, in order)."""
        calls = [(self._create, *self._create_call(new)) for new in jobs]
        replies = run_scripts(self.redis, [call[:3] for call in calls]) if calls else []
        outcomes: list[dict[str, Any] | QueueFullError] = []
        for (*_, encoded), outcome in zip(calls, replies, strict=True):
            try:
                outcomes.append(self._created(outcome, encoded))
            except QueueFullError as full:
                outcomes.append(full)
        return outcomes

    def _create_call(self, new: NewJob) -> tuple[list[str], list[Any], dict[str, str]]:
        now = time.time()
        job_id = new.job_id or new_id("job")
        fields: dict[str, Any] = {
            "id": job_id, "owner": new.owner, "kind": new.kind, "status": "queued", "created_at": now,
            "request_id": new.request_id or "", "request": new.request, "webhook": new.webhook,
            "metadata": new.metadata, **(new.extra or {}),
        }
        encoded = {name: _encode(name, value) for name, value in fields.items()}
        args: list[Any] = [self.limits.max_active_per_owner, self.limits.max_active_total, now, new.prompt or "",
                           self.limits.result_ttl, self.limits.events_maxlen, "1" if new.watched else "0"]
        for pair in encoded.items():
            args += pair
        names = [self.key(job_id), keys.owner_index_key(new.owner), self._active_key(new.owner), TOTAL_ACTIVE_KEY,
                 self.prompt_key(job_id), events_key(job_id), UNFINISHED_KEY, watch_key(job_id)]
        return names, args, encoded

    def _created(self, outcome: int, encoded: dict[str, str]) -> dict[str, Any]:
        if outcome == -1:
            raise QueueFullError("too many unfinished jobs for this API key", headers={"Retry-After": "5"})
        if outcome == -2:
            raise QueueFullError("the service has too many unfinished jobs", headers={"Retry-After": "5"})
        return self._decode(encoded)  # what the hash now holds, without reading it back

    def get(self, job_id: str, *, owner: str | None = None, stored_result: bool = False) -> dict[str, Any]:
        """The job, or NotFoundError — also when it belongs to another owner. ``stored_result``: its
        result left as stored (``get_many``'s), for a reply that sends it on."""
        raw = self.redis.hgetall(self.key(job_id)) if plausible_id(job_id) else {}
        if not raw or (owner is not None and raw.get(b"owner", b"").decode() != owner):
            raise NotFoundError(f"no job {job_id!r}")
        return _decode_stored_result(raw) if stored_result else self._decode(raw)

    def read_job(self, job_id: str) -> StoredJob | None:
        """The job typed (:class:`~domain.jobs.stored_job.StoredJob`), or None where it is gone."""
        raw = self.redis.hgetall(self.key(job_id)) if plausible_id(job_id) else {}
        return StoredJob.of(self._decode(raw)) if raw else None

    def check_owner(self, job_id: str, owner: str) -> None:
        """NotFoundError where ``get`` with ``owner`` raises one, reading two short fields: the
        record holds the result (up to tens of MB), which a stream reads later, once."""
        found, owned_by = self.redis.hmget(self.key(job_id), ["id", "owner"]) if plausible_id(job_id) else (None, None)
        if found is None or (owned_by or b"").decode() != owner:
            raise NotFoundError(f"no job {job_id!r}")

    def owned(self, job_ids: list[str], owner: str) -> list[dict[str, Any] | None]:
        """``get`` of many ids in one round trip: each job, or None where it is not ``owner``'s."""
        jobs = self.get_many([job_id for job_id in job_ids if plausible_id(job_id)])
        found = {job["id"]: job for job in jobs if job is not None and job.get("owner") == owner}
        return [found.get(job_id) for job_id in job_ids]

    def get_many(self, job_ids: list[str], *, stored_result: bool = False) -> list[dict[str, Any] | None]:
        """The jobs (None where gone), in one round trip. ``stored_result``: each result left as
        stored, a :class:`~domain.infra.redis_records.StoredJSON` (for a stream that sends it on)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.key(job_id))
        decode = _decode_stored_result if stored_result else self._decode
        return [decode(raw) if raw else None for raw in pipe.execute()]

    def existing(self, job_ids: list[str]) -> set[str]:
        """Which of ``job_ids`` have a record here, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(self.key(job_id))
        return {job_id for job_id, found in zip(job_ids, pipe.execute() if job_ids else [], strict=True) if found}

    def advance(self, job_id: str, status: str, *, owner: str | None = None, fence: Fence | None = None,
                **fields: Any) -> bool:
        """Move the job forward to ``status``; False if it is already there, past it, or ended, or
        ``fence``'s run is no longer the newest (domain/jobs/attempts.py). Pass ``owner`` when
        known: it saves a round trip."""
        if owner is None:
            owner = (self.redis.hget(self.key(job_id), "owner") or b"").decode()
        names, args = self._transition_call(job_id, owner, status, fields, fence)
        return self._transition(keys=names, args=args) == 1

    def advance_many(self, jobs: list[tuple[str, str]], status: str) -> list[bool]:
        """``advance`` for many ``(job id, owner)`` pairs in one round trip."""
        return self.advance_each([(job_id, owner, status, {}) for job_id, owner in jobs])

    def advance_each(self, moves: list[tuple[str, str, str, dict[str, Any]]]) -> list[bool]:
        """``advance`` for many ``(job id, owner, status, fields)`` in one round trip."""
        return [outcome == 1 for outcome in self.advance_fenced(moves, [None] * len(moves))]

    def advance_fenced(self, moves: list[tuple[str, str, str, dict[str, Any]]],
                       fences: list[Fence | None]) -> list[int]:
        """``advance_each``, each move made only while its fence holds: per move 1 (moved), 0 (it
        was there or past it), -1 (no such job) or ``FENCED`` (a newer run began: nothing written)."""
        calls = [(self._transition, *self._transition_call(job_id, owner, status, fields, fence))
                 for (job_id, owner, status, fields), fence in zip(moves, fences, strict=True)]
        return [int(outcome) for outcome in run_scripts(self.redis, calls)] if calls else []

    def _transition_call(self, job_id: str, owner: str, status: str, fields: dict[str, Any], fence: Fence | None):
        args: list[Any] = [status, _RANK[status], time.time(), self.limits.result_ttl, self.limits.events_maxlen,
                           "1" if owner in self.hooked_owners else "0", "" if fence is None else fence.number]
        for name, value in fields.items():
            args += [name, _encode(name, value)]
        names = [self.key(job_id), self._active_key(owner), TOTAL_ACTIVE_KEY, self.done_key(job_id),
                self.prompt_key(job_id), self.cancel_key(job_id), events_key(job_id), UNFINISHED_KEY,
                WEBHOOK_OWED_KEY, UNCOUNTED_LINES_KEY, fence.key if fence else preprocess_key(job_id),
                *redis_reservations.KEYS]
        return names, args

    def fail(self, job_id: str, error: RolloutError, *, fence: Fence | None = None) -> bool:
        # The code alone says the type (and its HTTP status): RolloutError.from_record.
        return self.advance(job_id, "failed", fence=fence, error=error.to_dict())

    def wait(self, job_id: str, *, timeout: float, stored_result: bool = False) -> dict[str, Any] | None:
        """Block until the job ends (or ``timeout`` seconds pass); the job, or None if still running."""
        job = self.get(job_id, stored_result=stored_result)
        if job["status"] in TERMINAL or timeout <= 0:
            return job if job["status"] in TERMINAL else None
        if self.wait_any_wakeup([self.done_key(job_id)], timeout):
            return self.get(job_id, stored_result=stored_result)
        job = self.get(job_id, stored_result=stored_result)
        return job if job["status"] in TERMINAL else None

    def wait_any(self, job_ids: list[str], *, timeout: float) -> dict[str, dict[str, Any] | None]:
        """Block until one of ``job_ids`` has ended, or ``timeout`` seconds pass: the records of those
        ended by then, by id (None for one no longer stored); empty when none has. One wait watches
        them all, so following a step's jobs costs a few round trips per group that ends together,
        not one per job."""
        if not job_ids:
            return {}  # nothing to wait for (a BLPOP of no keys is an error)
        ended = self._ended(job_ids)
        if not ended and timeout > 0 and self.wait_any_wakeup([self.done_key(j) for j in job_ids], timeout):
            ended = self._ended(job_ids)
        return dict(zip(ended, self.get_many(ended), strict=True)) if ended else {}

    def _ended(self, job_ids: list[str]) -> list[str]:
        """Those of ``job_ids`` that have ended or are no longer stored (one script reads their statuses)."""
        places = self._ended_places(keys=[self.key(job_id) for job_id in job_ids]) if job_ids else []
        return [job_ids[place - 1] for place in places]

    def save_prompt(self, job_id: str, prompt: str) -> None:
        """Leave the job's finalized prompt (JSON, see ``domain.jobs.prompt_codec``) for the GPU worker.
        It is deleted when the job ends."""
        self.redis.set(self.prompt_key(job_id), prompt, ex=self.limits.result_ttl)

    def claim_preprocessing(self, job_id: str) -> Fence:
        """Number a CPU task's run of the job: its prompt is saved, and the job failed, only while no
        newer run began (a worker paused past its heartbeat has its message run elsewhere)."""
        run = self._claim_preprocessing(keys=[preprocess_key(job_id)], args=[self.limits.result_ttl])
        return Fence.preprocessing(job_id, int(run))

    def save_prompt_fenced(self, job_id: str, prompt: str, fence: Fence, *, generating_ok: bool = False) -> bool:
        """``save_prompt`` for the run ``fence`` names, if it is still the newest and the job still
        waits for its prompt (``generating_ok``: also while generating, for handles made again).
        False: the run is late, send no ``generate``."""
        saved = self._save_prompt(keys=[self.key(job_id), self.prompt_key(job_id), fence.key],
                                  args=[fence.number, prompt, self.limits.result_ttl, "1" if generating_ok else "0"])
        return saved == 1

    def prompts(self, job_ids: list[str]) -> list[bytes | None]:
        """The jobs' finalized prompts as stored (JSON); None where a job has none (yet, or any more)."""
        return self.redis.mget([self.prompt_key(job_id) for job_id in job_ids]) if job_ids else []

    def with_prompts(self, job_ids: list[str]) -> list[tuple[dict[str, Any] | None, bytes | None]]:
        """Each job and its finalized prompt as stored (JSON), in one round trip; None where a job
        is gone, or has no prompt (yet, or any more)."""
        if not job_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.key(job_id))
        pipe.mget([self.prompt_key(job_id) for job_id in job_ids])
        *records, prompts = pipe.execute()
        return [(self._decode(raw) if raw else None, prompt) for raw, prompt in zip(records, prompts, strict=True)]

    def request_abort(self, job_id: str) -> None:
        """Ask the GPU worker running this job to stop (it ends the job with finish_reason abort)."""
        self.redis.set(self.cancel_key(job_id), 1, ex=self.limits.result_ttl)

    def list(self, *, owner: str, status: str | None, limit: int, cursor: str | None) -> tuple[list[dict], str | None]:
        """The owner's jobs, newest first, each as its :data:`SUMMARY_FIELDS` (no result). The
        cursor is the creation time of the last job seen. With a status, the jobs' statuses are
        read first and only the matching summaries loaded."""
        if status is None:
            return page_by_creation(self.redis, keys.owner_index_key(owner), limit=limit, cursor=cursor,
                                    load=self.summaries, keep=lambda job: True, filtered=False)
        return page_by_creation(self.redis, keys.owner_index_key(owner), limit=limit, cursor=cursor,
                                load=lambda ids: self._with_status(ids, status), keep=lambda job: job is not _OTHER)

    def summaries(self, job_ids: list[str]) -> list[dict[str, Any] | None]:
        """Each job's :data:`SUMMARY_FIELDS` (None where gone), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self.key(job_id), SUMMARY_FIELDS)
        return [None if values[0] is None else
                self._decode({name: value for name, value in zip(SUMMARY_FIELDS, values, strict=True) if value is not None})
                for values in pipe.execute()]

    def _with_status(self, job_ids: list[str], status: str) -> list[dict[str, Any] | None]:
        """The summary of each job of ``job_ids`` whose status is ``status``; ``_OTHER`` for the
        others, None for the expired (two round trips, the second only for the matches)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.key(job_id), "status")
        statuses = pipe.execute()
        matching = [job_id for job_id, found in zip(job_ids, statuses, strict=True) if found == status.encode()]
        loaded = dict(zip(matching, self.summaries(matching), strict=True))
        return [None if found is None else loaded.get(job_id, _OTHER)
                for job_id, found in zip(job_ids, statuses, strict=True)]

    def stalled(self, *, before: float, limit: int) -> list[str]:
        """Unfinished jobs that last moved (were created or changed status) before ``before``, oldest first."""
        return [job_id.decode() for job_id in self.redis.zrangebyscore(UNFINISHED_KEY, "-inf", before, 0, limit)]

    def reset_stall(self, job_ids: list[str]) -> None:
        """Restart these unfinished jobs' stall clock: a message was found carrying them, or was
        just sent again (so the next sweep looks at the jobs behind them)."""
        if job_ids:
            self.redis.zadd(UNFINISHED_KEY, dict.fromkeys(job_ids, time.time()), xx=True)

    def forget_unfinished(self, job_ids: list[str]) -> None:
        """Drop ids from the unfinished index (their records are gone, or ended before the index existed)."""
        if job_ids:
            self.redis.zrem(UNFINISHED_KEY, *job_ids)

    def uncounted_lines(self, *, before: float, limit: int) -> list[str]:
        """Ended jobs of batches, ended before ``before``, whose line is not counted yet; oldest first."""
        return [job_id.decode() for job_id in self.redis.zrangebyscore(UNCOUNTED_LINES_KEY, "-inf", before, 0, limit)]

    def lines_counted(self, job_ids: list[str]) -> None:
        """Drop these jobs' line debts unchecked: their records expired, or they name no line. A
        counted line's debt goes through ``BatchStore.settle_line_debts``, which checks the count."""
        if job_ids:
            self.redis.zrem(UNCOUNTED_LINES_KEY, *job_ids)

    def active_counts(self) -> int:
        return int(self.redis.get(TOTAL_ACTIVE_KEY) or 0)

    def active_count(self, owner: str) -> int:
        """How many of ``owner``'s jobs are unfinished (the counter the create script caps)."""
        return int(self.redis.get(self._active_key(owner)) or 0)

    @staticmethod
    def _decode(raw: dict[bytes, bytes] | dict[str, str]) -> dict[str, Any]:
        record = decode_record(raw, json_fields=_JSON_FIELDS, own_json_fields=_OWN_JSON_FIELDS)
        if record.get("result"):  # its masks as the lists every reply shows (stored packed)
            record["result"] = readable_result(record["result"])
        return record


def _decode_stored_result(raw: dict[bytes, bytes]) -> dict[str, Any]:
    return decode_record(raw, json_fields=_JSON_FIELDS, own_json_fields=_OWN_JSON_FIELDS, stored_fields=("result",))


def _encode(name: str, value: Any) -> str:
    return encode_field(name, value, _JSON_FIELDS)
