"""Batch records in Redis.

A batch is a JSONL file of job requests run offline. Every key of batch ``<id>`` starts with
``rq:batch:<id>``:

    rq:batch:<id>           hash: the record (fields below), counters ``total`` / ``completed`` /
                            ``failed``, ``chunk_size`` and ``chunks``
    rq:batch:<id>:lines     list: the valid input lines as JSON ``{line, custom_id, request, reply?}`` in
                            file order; chunk ``i`` is the slice ``[i * chunk_size, (i + 1) * chunk_size)``.
                            Deleted when the batch ends.
    rq:batch:<id>:jobs      hash: line number -> job id, for the lines that have a job. A redelivered
                            chunk task skips those lines; cancel and expiry walk it. Deleted at the end.
    rq:batch:<id>:ended     set: the line numbers already counted. A line is counted once, by
                            whoever sees it end first (its job, a cancel, the expiry).
    rq:batch:<id>:output    list: one JSON line per succeeded request
    rq:batch:<id>:errors    list: one JSON line per failed request (invalid lines included)
    rq:batch:<id>:submitted set: the chunks whose jobs are all made and here (``enqueue_chunk`` finished)
    rq:batch:<id>:scoring   set: the chunks owed a ``score_lines`` run (sent, not yet finished)
    rq:batches:<owner>      sorted set: the owner's batch ids by creation time (listing)
    rq:batches:open         sorted set: every batch not ended, by when the batch reaper last
                            looked at it (``domain/batches/reaper.py``)
    rq:batch-input:<owner>  hash: batch id -> bytes of its stored input lines, counted against
                            ``batch_max_stored_bytes_per_key`` with the owner's uploaded files
                            (``domain.batches.stored_input``)

Results stay in lists of one entry per line, so no Redis value grows with the batch and downloads
read them in pages. While a batch runs its keys live until ``expires_at + result_ttl``
(``keys_expire_at``); when it ends they are given ``result_ttl`` from then.

A batch made from an uploaded file (OpenAI's way) also records ``api``, ``endpoint`` and
``input_file_id``; every batch gets ``output_file_id`` / ``error_file_id`` when it ends with
results (``domain.batches.progress.publish_results``).

Statuses: ``validating`` → ``in_progress`` → ``finalizing`` → ``completed``; or ``failed`` (the
service lost some of its lines); ``cancelling`` → ``cancelled``; ``expired``. Moves are a Lua
compare-and-set, so of two racing callers only one moves a batch (and sends its webhook).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import redis

from domain.batches import scripts
from domain.batches.keys import (
    OPEN_KEY,
    batch_key,
    done_key,
    ended_key,
    errors_key,
    jobs_key,
    lines_key,
    output_key,
    owner_index_key,
    scoring_key,
    submitted_key,
)
from domain.batches.statuses import STATUS_TIMESTAMPS, TERMINAL
from domain.batches.stored_input import StoredInput
from domain.infra import finite_json, wakeups
from domain.infra.redis_records import (
    decode_record,
    encode_field,
    iter_list,
    new_id,
    page_by_creation,
    plausible_id,
)
from domain.jobs.keys import UNCOUNTED_LINES_KEY
from domain.jobs.store import JobStore
from domain.webhooks.store import BATCH_OWED_KEY  # ended batches whose webhook event is not made yet
from engine.errors import NotFoundError

_JSON_FIELDS = ("metadata", "webhook", "validation_errors")
_INT_FIELDS = ("total", "completed", "failed", "chunk_size", "chunks", "completion_window", "invalid_lines",
               "keys_expire_at", "intake")
PAGE = 1000

# The job id recorded for a line scored directly by ``rollout.batches.score_lines``: it has no job.
DIRECT_LINE = "direct"




class BatchStore:
    """``hooked_owners``: the owners with a key-wide webhook (``ROLLOUT_KEY_WEBHOOKS``), whose every
    batch's end owes one."""

    def __init__(self, client: redis.Redis, *, result_ttl: int, hooked_owners: frozenset[str] = frozenset(),
                 wait_any: wakeups.WaitAny | None = None):
        self.redis = client
        self.result_ttl = result_ttl
        self.hooked_owners = hooked_owners
        self.wait_any_wakeup = wait_any or wakeups.waiting_on(client)
        self._transition = client.register_script(scripts.TRANSITION)
        self._record = client.register_script(scripts.RECORD)
        self._close = client.register_script(scripts.CLOSE)
        self._settle_counted = client.register_script(scripts.SETTLE_COUNTED)
        self._mark_submitted = client.register_script(scripts.MARK_SUBMITTED)
        self._input = StoredInput(client)

    # --- Creating -------------------------------------------------------------------------------

    def create(self, *, owner: str, total: int, chunk_size: int, completion_window: int,
               metadata: dict | None = None, webhook: dict | None = None,
               source: dict[str, str] | None = None) -> dict[str, Any]:
        """A new batch in ``validating``, expecting ``total`` lines (invalid ones included), its
        intake open (:meth:`close_intake`); ``source``: text fields saying how it was made, kept as
        they are."""
        now = time.time()
        batch_id = new_id("batch")
        expires_at = now + completion_window
        fields = {
            "id": batch_id, "owner": owner, "status": "validating", "created_at": now,
            "expires_at": expires_at, "completion_window": completion_window,
            "keys_expire_at": int(expires_at + self.result_ttl), "total": total, "completed": 0,
            "failed": 0, "chunk_size": chunk_size, "chunks": 0, "invalid_lines": 0,
            "metadata": metadata, "webhook": webhook, "validation_errors": [],
            "intake": 1, "intake_at": now, **(source or {}),
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(batch_key(batch_id), mapping={name: _encode(name, value) for name, value in fields.items()})
        pipe.expireat(batch_key(batch_id), fields["keys_expire_at"])
        pipe.zadd(owner_index_key(owner), {batch_id: now})
        pipe.zadd(OPEN_KEY, {batch_id: now})
        pipe.execute()
        return self.get(batch_id)

    def reserve_input(self, batch: dict[str, Any], size: int, *, cap: int) -> int | None:
        """Count ``size`` bytes of input lines of ``batch`` (still ``validating``) against its
        owner's ``cap``. None when they fit; else nothing is counted and the answer is the bytes
        the owner's other unfinished batches hold."""
        ttl = int(batch["keys_expire_at"] - time.time())
        return self._input.reserve(batch["owner"], batch["id"], size, cap=cap, ttl=ttl)

    def discard(self, batch: dict[str, Any]) -> None:
        """Forget a batch refused (or abandoned) while its file was read, and everything it stored."""
        batch_id = batch["id"]
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(batch_key(batch_id), lines_key(batch_id), jobs_key(batch_id), ended_key(batch_id),
                    output_key(batch_id), errors_key(batch_id), submitted_key(batch_id), scoring_key(batch_id))
        pipe.zrem(owner_index_key(batch["owner"]), batch["id"])
        pipe.zrem(OPEN_KEY, batch["id"])
        self._input.forget(batch["owner"], batch["id"], pipe)
        pipe.execute()

    def add_lines(self, batch_id: str, lines: Iterable[str]) -> int:
        """Append valid input lines (JSON text); returns how many chunks the batch has now."""
        record = self.get(batch_id)
        pipe = self.redis.pipeline(transaction=False)
        page: list[str] = []
        for line in lines:
            page.append(line)
            if len(page) == PAGE:
                pipe.rpush(lines_key(batch_id), *page)
                page = []
        if page:
            pipe.rpush(lines_key(batch_id), *page)
        pipe.expireat(lines_key(batch_id), record["keys_expire_at"])
        pipe.execute()
        length = self.redis.llen(lines_key(batch_id))
        chunks = -(-length // record["chunk_size"])
        self.redis.hset(batch_key(batch_id), "chunks", chunks)
        return chunks

    def intake_progress(self, batch_id: str, *, invalid_lines: int, validation_errors: list[dict]) -> None:
        """The intake's counts so far, and the time it last wrote (the batch reaper's sign of life)."""
        self.redis.hset(batch_key(batch_id), mapping={
            "invalid_lines": invalid_lines, "intake_at": time.time(),
            "validation_errors": _encode("validation_errors", validation_errors)})

    def close_intake(self, batch_id: str) -> bool:
        """The file is read: the batch may settle now. True when every line was counted already
        (the caller ends it: ``domain.batches.progress.finish``)."""
        return self._close(keys=[batch_key(batch_id)]) == 1

    # --- Reading --------------------------------------------------------------------------------

    def get(self, batch_id: str, *, owner: str | None = None) -> dict[str, Any]:
        """The batch, or NotFoundError — also when it belongs to another owner."""
        raw = self.redis.hgetall(batch_key(batch_id)) if plausible_id(batch_id) else {}
        if not raw or (owner is not None and raw.get(b"owner", b"").decode() != owner):
            raise NotFoundError(f"no batch {batch_id!r}")
        return _decode(raw)

    def wait(self, batch_id: str, *, timeout: float) -> dict[str, Any]:
        """The batch once it has ended, or as it is after ``timeout`` seconds. An end since the
        caller's last read is not missed: its wake-up stays in the list."""
        self.wait_any_wakeup([done_key(batch_id)], timeout)
        return self.get(batch_id)

    def list(self, *, owner: str, status: str | None, limit: int,
             cursor: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The owner's batches, newest first. The cursor is the creation time of the last one seen."""
        return page_by_creation(self.redis, owner_index_key(owner), limit=limit, cursor=cursor, load=self.get_many,
                                 keep=lambda batch: status is None or batch["status"] == status)

    def get_many(self, batch_ids: list[str]) -> list[dict[str, Any] | None]:
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hgetall(batch_key(batch_id))
        return [_decode(raw) if raw else None for raw in pipe.execute()]

    def owner_and_webhook(self, batch_id: str) -> tuple[str | None, dict | None]:
        """The batch's owner and webhook (None for either when the batch or the field is gone)."""
        owner, webhook = self.redis.hmget(batch_key(batch_id), "owner", "webhook")
        return (owner.decode() if owner is not None else None), (json.loads(webhook) if webhook else None)

    def chunk(self, batch_id: str, index: int, chunk_size: int) -> list[dict[str, Any]]:
        return [json.loads(item) for item in self.chunk_text(batch_id, index, chunk_size)]

    def chunk_text(self, batch_id: str, index: int, chunk_size: int) -> list[bytes]:
        """Chunk ``index``'s lines as stored (JSON)."""
        start = index * chunk_size
        return self.redis.lrange(lines_key(batch_id), start, start + chunk_size - 1)

    def iter_lines(self, batch_id: str) -> Iterator[list[dict[str, Any]]]:
        """The valid input lines, a page at a time (for cancel and expiry sweeps)."""
        for page in iter_list(self.redis, lines_key(batch_id), PAGE):
            yield [json.loads(item) for item in page]

    def line_jobs(self, batch_id: str, lines: list[int]) -> dict[int, str]:
        """Line number -> job id, for those of ``lines`` that have a job."""
        if not lines:
            return {}
        job_ids = self.redis.hmget(jobs_key(batch_id), [str(n) for n in lines])
        return {n: job_id.decode() for n, job_id in zip(lines, job_ids, strict=True) if job_id}

    def set_line_job(self, batch_id: str, line: int, job_id: str, *, expire_at: int) -> None:
        self.set_line_jobs(batch_id, {line: job_id}, expire_at=expire_at)

    def set_line_jobs(self, batch_id: str, jobs: dict[int, str], *, expire_at: int) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(jobs_key(batch_id), mapping={str(line): job_id for line, job_id in jobs.items()})
        pipe.expireat(jobs_key(batch_id), expire_at)
        pipe.execute()

    def chunks_submitted(self, batch_id: str, index: int, lines: dict[int, str | None], *, expire_at: int) -> bool:
        """Chunk ``index`` has made a job (or a direct line) for each of its lines: ``lines`` maps
        each line to its job id (``DIRECT_LINE``; None for a line counted without one). It is marked
        only where the primary holds all of it (see ``scripts.MARK_SUBMITTED``): False when it does not (a
        batch gone owes nothing: True)."""
        keys = [submitted_key(batch_id), batch_key(batch_id), ended_key(batch_id), jobs_key(batch_id)]
        args: list[Any] = [index, expire_at, DIRECT_LINE]
        for line, job_id in lines.items():
            keys.append(JobStore.key(job_id) if job_id and job_id != DIRECT_LINE else batch_key(batch_id))
            args += [line, job_id or ""]
        return self._mark_submitted(keys=keys, args=args) != 0

    def owe_scoring(self, batch_id: str, index: int, *, expire_at: int) -> None:
        """A ``score_lines`` run of chunk ``index`` is about to be sent."""
        self._add_chunk(scoring_key(batch_id), index, expire_at)

    def scoring_done(self, batch_id: str, index: int, lines: list[int]) -> bool:
        """Chunk ``index``'s scoring run is done: its debt is dropped once the primary holds every
        one of its direct ``lines`` counted (see ``scripts.SETTLE_COUNTED``); False when it does not."""
        keys = [scoring_key(batch_id), batch_key(batch_id), ended_key(batch_id)]
        return self._settle_counted(keys=keys, args=["SREM", index, ",".join(map(str, lines))]) == 1

    def settle_line_debts(self, jobs: list[tuple[str, str, int]]) -> int:
        """``(job id, batch id, line)`` of ended jobs whose lines were recorded: their debts
        (``JobStore.uncounted_lines``) are dropped where the primary holds the line counted or the
        batch is gone; how many were (or had been)."""
        if not jobs:
            return 0
        keys, args = [UNCOUNTED_LINES_KEY], ["ZREM"]
        for job_id, batch_id, line in jobs:
            keys += [batch_key(batch_id), ended_key(batch_id)]
            args += [job_id, str(line)]
        return self._settle_counted(keys=keys, args=args)

    def chunk_progress(self, batch_id: str) -> tuple[set[int], set[int]]:
        """The chunks submitted, and those owed a scoring run."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(submitted_key(batch_id))
        pipe.smembers(scoring_key(batch_id))
        submitted, scoring = pipe.execute()
        return {int(i) for i in submitted}, {int(i) for i in scoring}

    def _add_chunk(self, key: str, index: int, expire_at: int) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(key, index)
        pipe.expireat(key, expire_at)
        pipe.execute()

    def open_batches(self, *, before: float, limit: int) -> list[str]:
        """Batches not ended that the reaper last looked at before ``before``, the oldest first."""
        return [raw.decode() for raw in self.redis.zrangebyscore(OPEN_KEY, "-inf", before, start=0, num=limit)]

    def looked_at(self, batch_ids: list[str]) -> None:
        if batch_ids:
            self.redis.zadd(OPEN_KEY, dict.fromkeys(batch_ids, time.time()), xx=True)

    def forget_open(self, batch_ids: list[str]) -> None:
        if batch_ids:
            self.redis.zrem(OPEN_KEY, *batch_ids)

    def ended(self, batch_id: str, lines: list[int]) -> set[int]:
        """Which of ``lines`` are counted already."""
        if not lines:
            return set()
        flags = self.redis.smismember(ended_key(batch_id), [str(n) for n in lines])
        return {n for n, flag in zip(lines, flags, strict=True) if flag}

    def iter_results(self, batch_id: str, which: str, page: int = PAGE) -> Iterator[list[bytes]]:
        """The output (``which="output"``) or error lines, a page at a time, as stored (JSON bytes).

        The lists only grow while the batch runs, so paging by index never skips or repeats a line.
        """
        return iter_list(self.redis, output_key(batch_id) if which == "output" else errors_key(batch_id), page)

    # --- Changing -------------------------------------------------------------------------------

    def record(self, batch_id: str, entries: list[tuple[int, bool, dict[str, Any]]]) -> bool:
        """Count lines as ended: (line, succeeded, output or error entry). Lines counted before are
        skipped. True for the one call that counted the batch's last line."""
        keys = [batch_key(batch_id), ended_key(batch_id), output_key(batch_id), errors_key(batch_id)]
        settled = False
        for start in range(0, len(entries), PAGE):  # the script pushes a call's lines in one command
            args: list[Any] = []
            for line, ok, entry in entries[start:start + PAGE]:
                args += [line, "completed" if ok else "failed", finite_json.compact(entry)]
            settled |= self._record(keys=keys, args=args) == 1
        return settled

    def move(self, batch_id: str, status: str, *, from_: Iterable[str], **fields: Any) -> bool:
        """Compare-and-set the status (stamping ``<status>_at``); False if it was not in ``from_``."""
        args = [status, ",".join(from_), time.time(), STATUS_TIMESTAMPS.get(status, ""), *sorted(self.hooked_owners)]
        moved = self._transition(keys=[batch_key(batch_id), BATCH_OWED_KEY, done_key(batch_id)], args=args) == 1
        if moved and fields:
            self.redis.hset(batch_key(batch_id), mapping={k: _encode(k, v) for k, v in fields.items()})
        if moved and status in TERMINAL:
            self.forget_open([batch_id])
        return moved

    def claim(self, batch_id: str, field: str, value: str) -> bool:
        """Set ``field`` unless it is set already; True for the one caller that set it."""
        return bool(self.redis.hsetnx(batch_key(batch_id), field, value))

    def results_count(self, batch_id: str, which: str) -> int:
        return self.redis.llen(output_key(batch_id) if which == "output" else errors_key(batch_id))

    def mark_broken(self, batch_id: str) -> None:
        """Some lines could not be run by the service: the batch will end ``failed``."""
        self.redis.hset(batch_key(batch_id), "broken", 1)

    def release(self, batch_id: str) -> None:
        """After the end: drop the inputs, keep the record and results for ``result_ttl``."""
        expire_at = int(time.time() + self.result_ttl)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(lines_key(batch_id), jobs_key(batch_id), submitted_key(batch_id), scoring_key(batch_id))
        pipe.hset(batch_key(batch_id), "keys_expire_at", expire_at)
        for key in (batch_key(batch_id), ended_key(batch_id), output_key(batch_id), errors_key(batch_id)):
            pipe.expireat(key, expire_at)
        pipe.execute()


def public_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """What ``GET /v1/batches/{id}`` returns and what batch webhooks carry."""
    batch_id = batch["id"]
    view: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "status": batch["status"],
        "request_counts": {"total": batch["total"], "completed": batch["completed"], "failed": batch["failed"]},
        "created_at": batch["created_at"],
    }
    for status in STATUS_TIMESTAMPS.values():
        view[status] = batch.get(status)
    view["expires_at"] = batch["expires_at"]
    view["completion_window"] = batch["completion_window"]
    view["metadata"] = batch.get("metadata")
    view["webhook"] = batch.get("webhook")
    view["errors"] = {"invalid_lines": batch.get("invalid_lines", 0), "data": batch.get("validation_errors") or []}
    base = f"/v1/batches/{batch_id}"
    view["links"] = {"self": base, "output": f"{base}/output", "errors": f"{base}/errors", "cancel": f"{base}/cancel"}
    return view


def _encode(name: str, value: Any) -> str:
    return encode_field(name, value, _JSON_FIELDS)


def _decode(raw: dict[bytes, bytes]) -> dict[str, Any]:
    return decode_record(raw, json_fields=_JSON_FIELDS, int_fields=_INT_FIELDS)
