"""The GPU task: open the finalized items, generate or score in batches, store results.

Batching: celery-batches hands this task the ``rollout.generate`` messages the worker has received
(up to ``ROLLOUT_GPU_BATCH_SIZE``; a partial batch waits at most ``ROLLOUT_GPU_BATCH_WAIT_MS`` while
more jobs are queued), and the engine runs them as one batch. We use celery-batches rather than a scheduler of our own because the messages are
already in Celery; transformers' continuous batching cannot serve this path (it drops
``pixel_values``, DESIGN §8). The worker's prefetch is raised to the batch size: celery-batches can
only batch messages the worker has reserved, so prefetch 1 would mean batches of one.

Time limit: Celery enforces no time limit here (celery-batches hands the batch to the pool without
one, and the solo pool the GPU worker runs has no enforcement anyway), so the batch keeps its own
deadline, ``ROLLOUT_TASK_SOFT_TIME_LIMIT`` seconds after it starts: ``should_abort`` stops every row
still decoding then, and those jobs fail with ``job_time_limit_exceeded``. The worker is then free
for the next batch, well before the visibility timeout would hand the messages to another worker.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from typing import Any

import redis
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from celery_batches import Batches, SimpleRequest
from celery_batches.trace import apply_batches_task

from engine.errors import HandleUnavailableError, JobTimeoutError, RolloutError
from workers.celery_app import SHARED_GENERATE_QUEUE
from workers.job_store import TERMINAL
from workers.lifecycle import end_job, fail_job, fail_unexpected
from workers.logs import job_context
from workers.metrics import count, observe_stage
from workers.prompt_codec import open_prompt, release_prompt
from workers.redis_client import REDIS_DOWN
from workers.runtime import runtime
from workers.submission import enqueue_preprocess

log = logging.getLogger(__name__)

ABORT_POLL_SECONDS = 0.05
REDIS_DOWN_POLL_PAUSE_SECONDS = 1.0
# What the batch returns when Redis went away under it: its messages go back to the queue.
REQUEUE = "requeue"


class ReconnectingBatches(Batches):
    """celery-batches' ``Batches``, made to survive a lost broker connection.

    ``Batches`` starts its flush timer once and remembers it in ``_tref``. When the connection to
    Redis drops, Celery clears the event loop's timers and restarts the consumer, so the remembered
    timer never fires again: requests then sit in the buffer until ``flush_every`` of them arrive,
    and their jobs hang in ``generating``. The consumer builds the strategy again on every
    (re)start, so forget the dead timer there and flush what the old connection left behind.
    """

    #: Longest a partial batch is held while more jobs wait in this worker's queues (seconds).
    max_wait = 0.02
    _oldest_buffered = 0.0

    def Strategy(self, task, app, consumer):
        handler = super().Strategy(task, app, consumer)
        self._tref = None
        if not (self._buffer.empty() and self._pending.empty()):
            self._tref = consumer.timer.call_repeatedly(self.flush_interval, self._do_flush)

        def buffer_request(*args, **kwargs):
            if self._buffer.empty():
                self._oldest_buffered = time.monotonic()
            return handler(*args, **kwargs)

        return buffer_request

    def _do_flush(self) -> None:
        """Flush on a full batch, when nothing more waits in the queues, or after ``max_wait``.

        celery-batches flushes whatever arrived on every timer tick; the worker reserves one
        message per Redis round trip, so 64 waiting jobs ran as batches of ~5. Holding a partial
        batch while the queues still hold jobs fills it; a lone job still goes at the next tick.
        """
        waiting = self._buffer.qsize()
        if (0 < waiting < self.flush_every and time.monotonic() - self._oldest_buffered < self.max_wait
                and self._more_queued()):
            return
        super()._do_flush()

    def _more_queued(self) -> bool:
        rt = runtime(self.app)
        try:
            pipe = rt.redis.pipeline(transaction=False)
            for queue in (rt.settings.generate_queue, SHARED_GENERATE_QUEUE):
                pipe.llen(queue)
            return sum(pipe.execute()) > 0
        except REDIS_DOWN:
            return False

    def flush(self, requests):
        """As ``Batches.flush``, but a batch that returns ``REQUEUE`` (Redis went away under it) puts
        its messages back instead of acknowledging them: an ack that lands once Redis is back would
        leave those jobs unfinished for good."""
        acks_early = [request for request in requests if not request.task.acks_late]
        acks_late = [request for request in requests if request.task.acks_late]

        def on_accepted(pid, time_accepted) -> None:
            for request in acks_early:
                request.acknowledge()

        def on_return(result) -> None:
            for request in acks_late:
                if result == REQUEUE:
                    request.reject(requeue=True)
                else:
                    request.acknowledge()

        return self._pool.apply_async(
            apply_batches_task, (self, ([SimpleRequest.from_request(r) for r in requests],), 0, None),
            accept_callback=on_accepted, callback=on_return,
        )


@shared_task(name="rollout.generate", base=ReconnectingBatches, bind=True, flush_every=16, flush_interval=0.005)
def generate(self, requests) -> str | None:
    rt = runtime(self.app)
    job_ids = list(dict.fromkeys(request.args[0] for request in requests))
    with job_context(*job_ids):
        try:
            _generate(rt, job_ids)
        except REDIS_DOWN:
            log.warning("Redis unavailable during a batch of %d jobs; their messages go back to the queue",
                        len(job_ids))
            return REQUEUE
    return None


def _generate(rt, job_ids: list[str]) -> None:
    try:
        engine = rt.wait_for_model()
    except Exception:
        for job_id in job_ids:
            fail_unexpected(rt, job_id, "loading the model")
        return
    try:
        run_batch(rt, engine, job_ids)
    except REDIS_DOWN:
        raise  # an outage, not these jobs' fault: the batch is requeued
    except Exception:
        # celery-batches only logs an exception from the batch body and leaves every job waiting;
        # end each job that is still open instead.
        for job_id in job_ids:
            fail_unexpected(rt, job_id, "generating")


def run_batch(rt, engine, job_ids: list[str]) -> None:
    deadline = time.monotonic() + rt.settings.task_soft_time_limit
    jobs = rt.jobs.get_many(job_ids)
    prompts = rt.redis.mget([rt.jobs.prompt_key(job_id) for job_id in job_ids])
    ready = []
    for job_id, job, raw in zip(job_ids, jobs, prompts, strict=True):
        if job is None or job["status"] in TERMINAL:
            continue
        if raw is None:
            enqueue_preprocess(rt.celery, job_id, retry_handles=True)
            continue
        try:
            prompt = open_prompt(json.loads(raw), device=engine.loaded.device)
        except HandleUnavailableError:
            # The producer died or its pool reclaimed the memory: preprocess again (cheap with the
            # multimodal cache) rather than fail the job.
            log.info("job %s: feature handles unavailable; preprocessing again", job_id)
            count(rt.redis, "handle_unavailable")
            enqueue_preprocess(rt.celery, job_id, retry_handles=True)
            continue
        ready.append((job, prompt))
    moved = rt.jobs.advance_many([(job["id"], job["owner"]) for job, _ in ready], "generating")
    running = []
    for (job, prompt), advanced in zip(ready, moved, strict=True):
        # Neither moved nor already generating (a redelivery): it was cancelled meanwhile.
        if advanced or job["status"] == "generating":
            running.append((job, prompt))
        else:
            release_prompt(rt.redis, prompt)
    ready = running
    try:
        for kind in ("generate", "score"):
            group = [(job, prompt) for job, prompt in ready if job["kind"] == kind]
            if group:
                _run_group(rt, engine, kind, group, deadline)
    finally:
        for _, prompt in ready:
            release_prompt(rt.redis, prompt)


def _run_group(rt, engine, kind: str, group: list[tuple[dict, Any]], deadline: float) -> None:
    started = time.perf_counter()
    timed_out: set[int] = set()
    try:
        outputs = _run_engine(rt, engine, kind, group, deadline, timed_out)
    except SoftTimeLimitExceeded:
        for job, _ in group:
            fail_job(rt, job["id"], JobTimeoutError("generation exceeded its time limit"))
        return
    except RolloutError:
        if len(group) == 1:
            raise
        # One bad request must not fail its batch mates: run each alone to find it.
        for member in group:
            _run_one(rt, engine, kind, member, deadline)
        return
    elapsed = time.perf_counter() - started
    observe_stage(rt.redis, kind, elapsed)
    for index, ((job, prompt), output) in enumerate(zip(group, outputs, strict=True)):
        if index in timed_out and any(choice.finish_reason == "abort" for choice in output.choices):
            limit = rt.settings.task_soft_time_limit
            fail_job(rt, job["id"], JobTimeoutError(f"generation exceeded its time limit ({limit} s)"))
        else:
            _store_result(rt, engine, job, prompt, output, elapsed, batch_size=len(group))


def _run_one(rt, engine, kind: str, member, deadline: float) -> None:
    try:
        _run_group(rt, engine, kind, [member], deadline)
    except RolloutError as error:
        fail_job(rt, member[0]["id"], error)


def _run_engine(rt, engine, kind: str, group, deadline: float, timed_out: set[int]):
    """The engine's outputs; fills ``timed_out`` with the rows stopped by the batch deadline."""
    from engine.generation import GenerationRequest
    from engine.scoring import ScoreRequest

    if kind == "score":
        return engine.score([
            ScoreRequest(prompt_token_ids=prompt.token_ids, completion_token_ids=job["request"]["completion_token_ids"],
                         items=prompt.items)
            for job, prompt in group
        ])
    requests = [
        GenerationRequest(prompt_token_ids=prompt.token_ids, items=prompt.items,
                          sampling=sampling_params(job["request"]["sampling_params"]), enqueued_at=job["created_at"])
        for job, prompt in group
    ]
    job_ids = [job["id"] for job, _ in group]
    last_poll = [0.0]
    aborted: set[int] = set()

    def should_abort() -> set[int]:
        # One MGET at most every ABORT_POLL_SECONDS, not one Redis round trip per decode step.
        now = time.monotonic()
        if now - last_poll[0] >= ABORT_POLL_SECONDS:
            last_poll[0] = now
            try:
                cancelled = rt.jobs.cancel_requested(job_ids)
            except redis.RedisError:
                # Redis is away: decode on, and look again in a second (each failed call waits on
                # reconnect attempts; one per poll would slow every step down).
                cancelled = set()
                last_poll[0] = now + REDIS_DOWN_POLL_PAUSE_SECONDS
            aborted.update(i for i, job_id in enumerate(job_ids) if job_id in cancelled)
        if now >= deadline and len(aborted) < len(job_ids):
            timed_out.update(i for i in range(len(job_ids)) if i not in aborted)
            aborted.update(timed_out)
        return aborted

    return engine.generate(requests, should_abort=should_abort)


def sampling_params(params: dict[str, Any]):
    from engine.sampling import SamplingParams

    return SamplingParams(
        max_tokens=params["max_tokens"], temperature=params["temperature"], top_p=params["top_p"],
        top_k=max(params["top_k"], 0), min_p=params["min_p"], n=params["n"], seed=params.get("seed"),
        stop_token_ids=tuple(params.get("stop_token_ids") or ()), ignore_eos=params["ignore_eos"],
        logprobs=params["logprobs"],
    )


def _store_result(rt, engine, job: dict, prompt, output, elapsed: float, *, batch_size: int) -> None:
    timings = {**prompt.timings, **(getattr(output, "timings", None) or {}), job["kind"]: elapsed,
               "batch_size": batch_size}
    result: dict[str, Any] = {
        "prompt_token_ids": prompt.token_ids,
        "placeholder_ranges": prompt.placeholder_ranges,
        "weight_version": engine.weight_version,
        "timings": timings,
        "transport": prompt.transport,
        # Where the prompt was preprocessed and where it was generated (handles never cross nodes).
        "nodes": {"preprocess": prompt.node_id, "generate": rt.settings.node_id},
    }
    status = "succeeded"
    if job["kind"] == "score":
        result.update(completion_logprobs=output.logprobs, usage=output.usage)
    else:
        choices = [asdict(choice) for choice in output.choices]
        result.update(choices=choices, usage=output.usage)
        if any(choice["finish_reason"] == "abort" for choice in choices):
            status = "cancelled"
    end_job(rt, job["id"], status, job=job, result=result)
