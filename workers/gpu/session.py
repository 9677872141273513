"""One run of the GPU worker's continuous batch: jobs join between decode steps, leave as they end.

The pool thread runs a session (``workers.tasks.gpu.generate``): it opens the jobs of the messages
it was handed, submits them to the engine's scheduler, and steps it. Between steps it polls
cancels and new readers (one MGET at most every ``ABORT_POLL_SECONDS``), ends the jobs that
finished (one round trip for all of a step's results), acknowledges their messages, and hands the
scheduler the buffered messages it has room for (``Scheduler.intake_room``: all of the worker's
prefetch, so the scheduler's fair admission sees every key waiting, not only those at the head of
the queue); Celery's event loop goes on reserving messages meanwhile
(``workers/tasks/gpu_batching.py``). The session returns when nothing runs and nothing is buffered.

Each job keeps its own deadline, ``ROLLOUT_TASK_SOFT_TIME_LIMIT`` seconds after the scheduler
admitted it: its rows stop then and it fails with ``job_time_limit_exceeded`` while the others go
on. A job the scheduler preempts (another key was below its share) stays in it and resumes where it
was (``engine/preemption.py``): its stream goes on. A request that
fails ends alone (the scheduler isolates it); score jobs run as a group when they arrive.

Streaming: the scheduler's per-step hook collects every row's new token; after the step the
session writes those of the jobs someone reads to their event streams in one pipeline
(``domain/jobs/events.py``), before the jobs that ended in that step are moved (so a stream's
tokens always precede its ``ended`` status). A reader that comes mid-job is seen at the next
cancel poll and gets the tokens so far (the scheduler's) in one entry. Each job's run here is
numbered (an attempt); a redo of a job whose worker died writes a ``restart`` event first.

Fencing (domain/jobs/attempts.py): the session's writes for a job (its tokens, its end, giving it
back to the queue) land only while its attempt is the newest. A worker paused past its heartbeat's
TTL has its messages run elsewhere meanwhile; when it wakes, its next write or its next poll (the
attempt counters are read with the cancel flags) finds its attempt superseded, and the session
aborts those rows in the scheduler and drops them: nothing written, its prompt left to the newer
attempt, its message settled. A message of a job this session already runs joins that run.

Redis at its maxmemory (``noeviction``): a write it refuses fails no job and ends no session. The
ends of finished jobs are held and written again, and no new work is taken meanwhile
(``workers/gpu/job_ends.py``); staged tokens wait for the next flush; jobs that could not begin, or
be sent back, go back to the queue by their own messages (``GenerateBatches.hand_back``).

Weight updates in mode keep: the stretch ends with its rows still in the scheduler, the next loads
the target, and the rows go on under it (``_follow_swap``); a keep pause holds them still meanwhile.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from domain.infra.heartbeats import heartbeat_key
from domain.jobs.attempts import Fence
from domain.jobs.prompt_codec import release_prompts
from domain.jobs.stream_text import StreamText
from domain.lifecycle import fail_job
from domain.names import worker_name
from engine.errors import InternalError, JobTimeoutError, RolloutError
from engine.generation_types import GenerationRequest
from workers.gpu.adapter_sync import engine_adapter
from workers.gpu.job_ends import JobEnds
from workers.gpu.jobs import ending, open_jobs, poll_session, run_score_jobs
from workers.gpu.live_job import ChoiceStream, LiveJob
from workers.gpu.requeue import REQUEUE
from workers.gpu.session_metrics import SessionMetrics
from workers.memory_refusal import refused_for_memory

log = logging.getLogger(__name__)

ABORT_POLL_SECONDS = 0.05
REDIS_DOWN_POLL_PAUSE_SECONDS = 1.0
# How long staged tokens wait after Redis refused them for memory before the next try.
TOKENS_REFUSED_PAUSE_SECONDS = 0.5
# How long a session waits for a paused or failed worker to serve again before its messages go back.
WEIGHTS_HOLD_SECONDS = 2.0



class GenerateSession:
    def __init__(self, rt, engine, batches):
        self._step_tokens: list = []  # RowTokens of the step in progress (the scheduler's hook adds them)
        self.rt = rt
        self.engine = engine
        self.batches = batches
        self.scheduler = engine.scheduler(on_step=self._on_step)
        self.live: dict[int, LiveJob] = {}
        self._swaps = engine.swaps  # the engine's weight swaps this session has followed
        # What this worker's attempts are held by (its heartbeat key, domain/jobs/attempts.py).
        self.holder = heartbeat_key("gpu", worker_name(rt.settings.node_id))
        self._by_job: dict[str, LiveJob] = {}
        # Tokens not yet written, by (job id, attempt) then choice (see _publish).
        self._unflushed: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
        self._flush_every = rt.settings.stream_flush_ms / 1000
        self._next_flush = 0.0
        self._tokens_refused_until = 0.0
        self._next_poll = 0.0
        self._stats = SessionMetrics(engine)
        self._ends = JobEnds(rt, batches, metrics=self._stats.batch, flush_tokens=self._flush_tokens)

    def run(self, requests) -> str | None:
        """Run until nothing runs and nothing is buffered; returns ``REQUEUE`` when this worker may
        not serve (paused, or the fleet's target failed to load here): the messages not yet
        admitted then go back to the queue."""
        sync = self.rt.weight_sync
        pending = list(requests)
        try:
            while True:
                # One stretch on one set of weights: a pending target is loaded here, between
                # stretches, never while a row decodes; rows held for it (mode keep) go on under it.
                with sync.batch(WEIGHTS_HOLD_SECONDS) as may_serve:
                    self._follow_swap(sync)
                    if not may_serve and not self.scheduler.has_work and not self._ends.holding:
                        return REQUEUE  # held ends are written first: returning would leave them unwritten
                    if may_serve:
                        self._admit(pending)
                        pending = []
                    if sync.holds_rows:  # paused in mode keep: the rows hold still until it ends
                        continue
                    self._decode_until_idle_or_update(sync, intake=may_serve)
                    if self._ends.holding and not self.scheduler.has_work:
                        self._ends.held.wait()  # Redis refused job ends for memory: try again, take nothing
                        self._ends.retry()
                        continue
                    if not self.scheduler.has_work and not sync.update_pending:
                        pending = self.batches.take(self.batches.flush_every)
                        if not pending:
                            return None
        finally:
            # Rows still running (an outage or an error ends the session) give their KV blocks back:
            # their jobs run again from their messages.
            self.scheduler.close()
            try:
                self._flush_tokens()
            except redis.RedisError:
                log.warning("Redis unavailable: the last tokens of this session were not streamed")
            self._stats.report(self.rt.redis, every=0)

    def _decode_until_idle_or_update(self, sync, *, intake: bool) -> None:
        """Step while rows run. Rows join between steps (``intake``) unless a weight update (or
        pause) is pending; one in mode abort or retract stops the rows in flight (see
        ``_interrupt``), one in mode keep leaves them in the scheduler for the next stretch."""
        while self.scheduler.has_work:
            if sync.holds_rows:
                sync.note_held(len(self.live))
                return
            mode = sync.interruption()  # no Redis call: the weight watcher keeps it fresh
            if mode is not None:
                self._interrupt(mode)
            self._poll_cancels()
            finished = self.scheduler.step()
            self._publish(finished)
            if finished:
                self._end(finished)
            self._ends.retry()
            if intake and self.scheduler.intake_room and not sync.update_pending and not self._ends.holding:
                more = self.batches.take(self.scheduler.intake_room)
                if more:
                    self._admit(more)
            self._stats.report(self.rt.redis)

    def _follow_swap(self, sync) -> None:
        """The weights changed since the last stretch: the rows held for it go on under them."""
        if self.engine.swaps != self._swaps:
            self._swaps = self.engine.swaps
            if self.scheduler.has_work:
                self.scheduler.weights_changed(recompute_kv=sync.recompute_kv)

    def _interrupt(self, mode: str) -> None:
        """Stop every row in flight for a weight update: ``abort`` ends them with their tokens so
        far; ``retract`` sends their jobs back to run again from the prompt on the new weights."""
        for handle, live in self.live.items():
            if live.stopped_by is None and not live.superseded:
                live.stopped_by = mode
                self.scheduler.abort(handle)

    # --- joining -------------------------------------------------------------------------------

    def _admit(self, requests) -> None:
        rt = self.rt
        messages: dict[str, list[str]] = {}
        for request in requests:
            job_id = request.args[0]
            if job_id in self._by_job:  # a second message of a job running here joins its run
                self._by_job[job_id].message_ids.append(request.id)
                continue
            messages.setdefault(job_id, []).append(request.id)
        try:
            ready, settled = open_jobs(rt, list(messages), device=self.engine.loaded.device, holder=self.holder)
        except Exception as error:
            if not refused_for_memory(rt.redis, error):
                raise
            log.warning("Redis is at its maxmemory: %d jobs not begun go back to the queue", len(messages))
            self.batches.hand_back([mid for mids in messages.values() for mid in mids])
            return
        self.batches.acknowledge([mid for job_id in settled for mid in messages[job_id]])
        scores = [(job, prompt) for job, prompt in ready if job.kind == "score"]
        if scores:
            score_messages = [mid for job, _ in scores for mid in messages[job.id]]
            try:
                run_score_jobs(rt, self.engine, scores)
            except Exception as error:
                if not refused_for_memory(rt.redis, error):
                    raise
                self.batches.hand_back(score_messages)  # scored again once Redis has room; prompts kept
                scores = score_messages = []
            finally:
                release_prompts(rt.redis, [prompt for _job, prompt in scores])
                self.batches.acknowledge(score_messages)
        for job, prompt in ready:
            if job.kind != "generate":
                continue
            attempt = job.attempt
            try:
                request = GenerationRequest(prompt_token_ids=prompt.token_ids, items=prompt.items,
                                            sampling=job.request.sampling, enqueued_at=job.created_at,
                                            cache_scope=job.cache_scope, tenant=job.owner,
                                            adapter=engine_adapter(job.adapter_id, self.engine.adapter_ids))
                features = self.scheduler.check(request)
            except Exception as error:  # whatever one request raises, it fails alone
                if fail_job(rt, job.id, _job_error(job.id, error), fence=Fence.generation(job.id, attempt.number)):
                    release_prompts(rt.redis, [prompt])  # not a superseded attempt's: the newer one uses it
                self.batches.acknowledge(messages[job.id])
                continue
            handle = self.scheduler.submit(request, tag=job.id, time_limit=rt.settings.task_soft_time_limit,
                                           features=features)
            live = LiveJob(job, prompt, messages[job.id], request.sampling, attempt=attempt.number)
            self.live[handle] = live
            self._by_job[job.id] = live
            if attempt.watched:
                self._watch(handle, live)

    def _watch(self, handle: int, live: LiveJob) -> None:
        """The job has a reader from now on: publish its tokens, those so far at the next flush."""
        live.watched = True
        tokenizer = self.engine.loaded.tokenizer
        detokenize = live.sampling.detokenize and tokenizer
        for choice in self.scheduler.tokens_so_far(handle):
            live.streams[choice.index] = ChoiceStream(text=StreamText(tokenizer, live.sampling) if detokenize else None)
            self._stage(live, choice.index, choice.token_ids, choice.logprobs, choice.finish_reason)

    # --- between steps -------------------------------------------------------------------------

    def _on_step(self, rows) -> None:
        self._step_tokens.extend(rows)

    def _publish(self, finished) -> None:
        """This step's tokens of the jobs someone reads, one entry per job, all jobs in one round
        trip. A choice's text is sent as it commits; its last delta comes from the result (cut at
        a stop string) when its job ends. Steps faster than ``ROLLOUT_STREAM_FLUSH_MS`` are
        coalesced (one entry carries several tokens per choice): a first entry, and every step in
        which a job ends (its tokens must precede its terminal status), flush at once."""
        tokens, self._step_tokens = self._step_tokens, []
        for row in tokens:
            live = self._by_job.get(row.tag)
            if live is not None and live.watched and not live.superseded:
                self._stage(live, row.choice, [row.token_id], None if row.logprob is None else [row.logprob],
                            row.finish_reason)
        for item in finished:
            live = self._by_job.get(item.tag)
            if (live is None or not live.watched or live.superseded or item.result is None
                    or live.stopped_by == "retract"):
                continue
            for choice in item.result.choices:
                stream = live.streams.get(choice.index)
                if stream is None or stream.text is None or stream.text.finished:
                    continue
                tail = stream.text.finish(choice.text)
                if tail:
                    out = self._entry(live, choice.index)
                    out["text"] += tail
                    out["finish_reason"] = choice.finish_reason
        if not self._unflushed:
            return
        now = time.monotonic()
        first = any(out["offset"] == 0 for choices in self._unflushed.values() for out in choices.values())
        if (finished or first or now >= self._next_flush) and now >= self._tokens_refused_until:
            try:
                self._supersede(self._flush_tokens())
            except Exception as error:
                if not refused_for_memory(self.rt.redis, error):
                    raise
                # Redis at its maxmemory: the tokens stay staged, and go before their jobs' ends.
                self._tokens_refused_until = now + TOKENS_REFUSED_PAUSE_SECONDS
            self._next_flush = now + self._flush_every

    def _entry(self, live: LiveJob, index: int) -> dict[str, Any]:
        """The choice's entry of the next flush (started at the first token not yet staged)."""
        choices = self._unflushed.setdefault((live.job.id, live.attempt), {})
        if index not in choices:
            stream = live.streams[index]
            choices[index] = {"index": index, "offset": stream.sent, "token_ids": [], "finish_reason": None}
            if stream.text is not None:
                choices[index]["text"] = ""
        return choices[index]

    def _stage(self, live: LiveJob, index: int, token_ids: list[int], logprobs: list[float] | None,
               finish_reason: str | None) -> None:
        """Add the choice's next tokens to the next flush's entry. The token a row finishes with is
        not detokenized: its text comes from the result."""
        if not token_ids:
            return
        stream = live.streams[index]
        out = self._entry(live, index)
        out["token_ids"] += token_ids
        if logprobs is not None:
            out.setdefault("logprobs", []).extend(logprobs)
        if stream.text is not None:
            pushed = token_ids[:-1] if finish_reason is not None else token_ids
            out["text"] += "".join(stream.text.push(token_id) for token_id in pushed)
        out["finish_reason"] = finish_reason
        stream.sent += len(token_ids)

    def _flush_tokens(self) -> set[str]:
        """Write the staged tokens; the jobs whose attempt was superseded (their tokens were not written)."""
        entries, self._unflushed = self._unflushed, {}
        if not entries:
            return set()
        try:
            return self.rt.events.publish_tokens([(job_id, attempt, list(choices.values()))
                                                  for (job_id, attempt), choices in entries.items()])
        except redis.RedisError:
            self._unflushed = entries  # nothing was staged meanwhile: written whole at the next flush
            raise

    def _supersede(self, job_ids) -> None:
        """A newer attempt of these jobs began elsewhere: stop their rows here (they end at the next
        step, and ``_end`` drops them) and write nothing more for them."""
        for handle, live in self.live.items():
            if live.job.id in job_ids and not live.superseded:
                log.warning("job %s: attempt %d was superseded by a newer one elsewhere; dropping its rows",
                            live.job.id, live.attempt)
                live.superseded = True
                self.scheduler.abort(handle)

    def _poll_cancels(self) -> None:
        """Which running jobs were cancelled, which got a reader, and which a newer attempt took
        over (one MGET)."""
        now = time.monotonic()
        if now < self._next_poll or not self.live:
            return
        self._next_poll = now + ABORT_POLL_SECONDS
        by_job = {live.job.id: handle for handle, live in self.live.items()}
        unwatched = [job_id for job_id, live in self._by_job.items() if not live.watched]
        attempts = {job_id: live.attempt for job_id, live in self._by_job.items() if not live.superseded}
        try:
            polled = poll_session(self.rt.redis, attempts, list(by_job), unwatched)
        except redis.RedisError:
            # Redis is away: decode on, and look again in a second (each failed call waits on
            # reconnect attempts; one per poll would slow every step down).
            self._next_poll = now + REDIS_DOWN_POLL_PAUSE_SECONDS
            return
        self._supersede(polled.superseded)
        for job_id in polled.cancelled:
            self.scheduler.abort(by_job[job_id])
        for job_id in polled.watched - polled.superseded:
            self._watch(by_job[job_id], self._by_job[job_id])

    def _end(self, finished) -> None:
        rt = self.rt
        endings, ended, retracted, superseded, durations = [], [], [], [], []
        for item in finished:
            live = self.live.pop(item.handle)
            self._by_job.pop(item.tag, None)
            job = live.job.record  # what the job ends from (domain/lifecycle.py)
            if live.superseded:
                superseded.append(live)  # the newer attempt ends the job and releases its prompt
                continue
            if live.stopped_by == "retract" and item.error is None:
                retracted.append(live)  # runs again on the new weights: its prompt stays held
                continue
            elapsed = time.perf_counter() - live.started
            durations.append(elapsed)
            if item.error is not None:
                endings.append((job, "failed", {"error": _job_error(live.job.id, item.error).to_dict()}))
            elif item.timed_out:
                limit = rt.settings.task_soft_time_limit
                error = JobTimeoutError(f"generation exceeded its time limit ({limit} s)")
                endings.append((job, "failed", {"error": error.to_dict()}))
            else:
                endings.append(ending(rt, self.engine, live.job, live.prompt, item.result, elapsed,
                                      batch_size=item.batch_rows, stopped_by_weights=live.stopped_by is not None))
            ended.append(live)
        self._stats.batch.observe_stage("generate", *durations)
        self._ends.finish(ended, endings, retracted, superseded)


def _job_error(job_id: str, error: BaseException) -> RolloutError:
    """The error a job ends with: typed errors as they are; anything else is logged here and
    reaches the client as ``internal_error``, never with its text."""
    if isinstance(error, RolloutError):
        return error
    log.error("job %s: unexpected error while generating", job_id, exc_info=error)
    return InternalError("internal error while generating")
