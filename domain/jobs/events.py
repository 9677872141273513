"""A job's events: one bounded Redis Stream per job, ``rq:job:<id>:events``, with the job's TTL.

Why a Stream and not pub/sub: a reader that connects late (or reconnects with ``Last-Event-ID``)
replays from any point; pub/sub drops what was sent while nobody listened. Every streamed view
(``GET /v1/jobs/{id}/events``, each dialect's ``stream: true``) reads this one stream, so what a
stream delivers is what the job produced.

Entries (field ``t`` is the type, ``d`` its JSON):

- ``status`` ``{"status": ...}``: written by the job store's own transition script
  (``domain/jobs/store.py``) in the same atomic call that moves the job, so a stream never says a
  job ended before its record does, and no path that ends a job can forget to say so.
- ``restart`` ``{"attempt": N}``: attempt N (N > 1) of the job's generation began (its GPU worker
  was killed and the message was redelivered, or a weight update retracted it). Tokens of every
  earlier attempt are void: the new attempt generates from the prompt again.
- ``tokens`` ``{"attempt": N, "choices": [{"index", "offset", "token_ids", "logprobs"?,
  "text"?, "finish_reason"}]}``: one entry per job per flush (all of its rows; a flush per decode
  step, or per ``ROLLOUT_STREAM_FLUSH_MS`` when steps are faster), ``offset`` the index of the
  choice's first token in the entry. ``text`` is the committed text delta
  where the row detokenizes (held back near a possible stop string; see ``domain.jobs.stream_text``).

Redo after a kill -9 (the guarantee: delivered tokens equal the final result's, in order, none
twice): tokens carry their attempt and offset. The native events route passes ``restart`` on and
its readers drop the void attempt's tokens (the Python client does). A dialect stream cannot take
tokens back, so it continues only where it can prove equality: the new attempt's tokens at offsets
already delivered must equal them (they are skipped) and only later ones are sent; a mismatch
ends the stream with a ``stream_diverged`` error (``domain.jobs.follow.TokenLedger``). Once a
redo's ``restart`` is written, the older attempt writes nothing more: token entries are written by a
script that checks the writer's attempt is the newest (``domain/jobs/attempts.py``), so a worker
that only seemed dead and wakes later cannot add tokens behind the restart.

Tokens are written only for jobs someone reads (``rq:job:<id>:watched``). Every reader marks
the jobs it follows (:meth:`JobEvents.watch`, called by ``domain.jobs.follow.follow``), and a job
submitted to be streamed (a dialect's ``stream: true``, ``stream_events`` on ``POST /v1/jobs``) is
marked as it is created (``JobStore.create``). The GPU session learns it as the job's attempt
begins, or at its next cancel poll for a reader that comes mid-job, and then writes the job's
tokens so far as one entry from offset 0, and every flush after
(one pipeline per flush for all of its watched rows: one round trip, ``XADD ... MAXLEN ~``). A job
nobody reads costs no token writes; a reader that comes after it ended has its tokens from the
result (the native route's ``result`` event, a dialect's ``TokenLedger.finish``). Status and
restart events are written for every job. ``bench/streaming.py`` measures what publishing costs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from domain.infra import finite_json
from domain.infra.pipelined_scripts import run_scripts
from domain.infra.redis_records import plausible_id
from domain.jobs.attempts import FENCED, attempt_key, fence_lua, holder_key

# Roughly (MAXLEN ~) the entries kept per job: one per flush, so a job longer than this
# loses its first tokens from the stream (a reader then sees a gap and says so; the result keeps all).
DEFAULT_MAXLEN = 20_000

# KEYS: events, attempt counter, watch mark, holder, job record. ARGV: ttl, maxlen, this worker's
# heartbeat key ('' for none), job id. Returns {attempt number, watched}; {0, 0} where the job has
# ended, or another worker alive holds its newest attempt and lists the job as running (attempts.py).
_BEGIN_ATTEMPT = """
local status = redis.call('HGET', KEYS[5], 'status')
if status == 'succeeded' or status == 'failed' or status == 'cancelled' then return {0, 0} end
local holder = redis.call('GET', KEYS[4])
if holder and ARGV[3] ~= '' and holder ~= ARGV[3] then
  local beat = redis.call('GET', holder)
  local running = beat and cjson.decode(beat)['running']
  if type(running) == 'table' then
    for _, id in ipairs(running) do
      if id == ARGV[4] then return {0, 0} end
    end
  end
end
local attempt = redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[1]))
if ARGV[3] ~= '' then redis.call('SET', KEYS[4], ARGV[3], 'EX', tonumber(ARGV[1])) end
if attempt > 1 then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', tonumber(ARGV[2]), '*', 't', 'restart', 'd',
             '{"attempt":' .. attempt .. '}')
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
end
return {attempt, redis.call('EXISTS', KEYS[3])}
"""

# KEYS: events, attempt counter. ARGV: the writer's attempt, maxlen, the entry's JSON. Returns 1, or
# FENCED (nothing written) where a newer attempt began.
_PUBLISH_TOKENS = fence_lua(key="KEYS[2]", number="ARGV[1]") + """
redis.call('XADD', KEYS[1], 'MAXLEN', '~', tonumber(ARGV[2]), '*', 't', 'tokens', 'd', ARGV[3])
return 1
"""

# KEYS: attempt counter, holder. ARGV: the releasing attempt. Returns 1, or FENCED where a newer
# attempt began (that one holds the job now).
_RELEASE_ATTEMPT = fence_lua(key="KEYS[1]", number="ARGV[1]") + """
redis.call('DEL', KEYS[2])
return 1
"""

# What job_store's Lua scripts append, spelled here once (they format it with the status word).
STATUS_EVENT_LUA = (
    "redis.call('XADD', {key}, 'MAXLEN', '~', tonumber({maxlen}), '*', 't', 'status', 'd', "
    "'{{\"status\":\"' .. {status} .. '\"}}')"
)


@dataclass(frozen=True)
class Attempt:
    number: int  # 1, 2, ...: a redo's number is above 1
    watched: bool  # someone follows the job's events: write its tokens


@dataclass(frozen=True)
class JobEvent:
    id: str  # the stream entry id: what SSE sends as ``id:`` and takes back as Last-Event-ID
    type: str  # status | restart | tokens
    data: dict[str, Any]


def events_key(job_id: str) -> str:
    return f"rq:job:{job_id}:events"


def watch_key(job_id: str) -> str:
    """Set while the job's events may have a reader: its tokens are then written."""
    return f"rq:job:{job_id}:watched"


def plausible_event_id(value: str | None) -> bool:
    """Whether ``value`` is a stream entry id Redis takes (``ms-seq``, each part a 64-bit unsigned
    integer): a longer number is a Redis error on read, not an id of this stream."""
    if not value or len(value) > 41:
        return False
    ms, dash, seq = value.partition("-")
    if not (ms.isascii() and ms.isdigit() and (not dash or (seq.isascii() and seq.isdigit()))):
        return False  # "1-" too: Redis refuses it on read
    return int(ms) < 2**64 and (seq == "" or int(seq) < 2**64)


class JobEvents:
    """Reads and writes of the per-job event streams."""

    def __init__(self, client: redis.Redis, *, ttl: int, maxlen: int = DEFAULT_MAXLEN):
        self.redis = client
        self.ttl = ttl
        self.maxlen = maxlen
        self._begin = client.register_script(_BEGIN_ATTEMPT)
        self._publish = client.register_script(_PUBLISH_TOKENS)
        self._release = client.register_script(_RELEASE_ATTEMPT)

    # --- writing (the GPU session) -------------------------------------------------------------

    def begin_attempts(self, job_ids: list[str], *, holder: str = "") -> list[Attempt | None]:
        """Number each job's new generation attempt (1, 2, ...) and say whether it has a reader,
        in one round trip; a redo (attempt > 1) writes its ``restart`` event in the same call.
        ``holder``: the beginning worker's heartbeat key, recorded as the attempt's holder. None
        where the job has ended, or another live worker holds it and runs it (domain/jobs/attempts.py)."""
        calls = [(self._begin, [events_key(job_id), attempt_key(job_id), watch_key(job_id), holder_key(job_id),
                                f"rq:job:{job_id}"],  # the record (JobStore.key)
                  [self.ttl, self.maxlen, holder, job_id])
                 for job_id in job_ids]
        return [Attempt(int(number), bool(watched)) if number else None
                for number, watched in run_scripts(self.redis, calls)]

    def publish_tokens(self, deltas: list[tuple[str, int, list[dict[str, Any]]]]) -> set[str]:
        """One decode step's ``(job id, attempt, choices)`` for every job with new tokens: one
        pipeline, one round trip. The key's TTL was set when the job was created. Returns the jobs
        whose attempt is no longer the newest: nothing was written for them (they are fenced)."""
        if not deltas:
            return set()
        calls = [(self._publish, [events_key(job_id), attempt_key(job_id)],
                  [attempt, self.maxlen, finite_json.compact({"attempt": attempt, "choices": choices})])
                 for job_id, attempt, choices in deltas]
        return {job_id for (job_id, _, _), written in zip(deltas, run_scripts(self.redis, calls), strict=True)
                if written == FENCED}

    def release_attempts(self, attempts: list[tuple[str, int]]) -> list[bool]:
        """Give up each ``(job id, attempt)``'s hold before its job goes back to the queue, so that any
        worker may begin the next attempt; False where a newer attempt began (do not send it again)."""
        if not attempts:
            return []
        calls = [(self._release, [attempt_key(job_id), holder_key(job_id)], [attempt]) for job_id, attempt in attempts]
        return [released == 1 for released in run_scripts(self.redis, calls)]

    # --- reading (the API) ---------------------------------------------------------------------

    def watch(self, job_ids: list[str]) -> None:
        """Mark the jobs as read, for as long as their events live: from now on their tokens are
        written (a job already generating catches up at the session's next poll)."""
        ids = [job_id for job_id in job_ids if plausible_id(job_id)]
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.set(watch_key(job_id), 1, ex=self.ttl)
            pipe.execute()

    def read(self, positions: dict[str, str], *, block_ms: int | None) -> list[tuple[str, JobEvent]]:
        """``(job id, event)`` after each job's position (``"0"``: from the start), waiting up to
        ``block_ms`` for the first one (None: do not wait). One XREAD for all the jobs."""
        streams = {events_key(job_id): after for job_id, after in positions.items() if plausible_id(job_id)}
        if not streams:
            return []
        reply = self.redis.xread(streams, block=block_ms, count=512)
        out = []
        for key, entries in reply or []:
            job_id = (key.decode() if isinstance(key, bytes) else key).split(":")[2]
            for entry_id, fields in entries:
                out.append((job_id, parse_event(entry_id, fields)))
        return out

    def all(self, job_id: str) -> list[JobEvent]:
        """Every event still in the job's stream, oldest first (tests, the CLI's replay)."""
        return [parse_event(entry_id, fields) for entry_id, fields in self.redis.xrange(events_key(job_id))]


def parse_event(entry_id: bytes | str, fields: dict) -> JobEvent:
    """One stream entry as the event it holds."""
    def text(value):
        return value.decode() if isinstance(value, bytes) else value

    decoded = {text(k): text(v) for k, v in fields.items()}
    return JobEvent(text(entry_id), decoded.get("t", ""), json.loads(decoded.get("d") or "{}"))
