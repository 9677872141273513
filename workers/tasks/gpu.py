"""The GPU task: open the finalized items, generate or score in batches, store results.

Batching: :class:`workers.gpu_batching.GenerateBatches` hands this task the ``rollout.generate``
messages the worker has reserved (up to ``ROLLOUT_GPU_BATCH_SIZE``), and the engine runs them as
one batch in the worker's single pool thread. transformers' continuous batching cannot serve this
path (it drops ``pixel_values``, DESIGN §8).

Time limit: Celery enforces none here (celery-batches hands the batch to the pool without one, and
the threads pool cannot interrupt a thread anyway), so the batch keeps its own deadline,
``ROLLOUT_TASK_SOFT_TIME_LIMIT`` seconds after it starts: ``should_abort`` stops every row still
decoding then, and those jobs fail with ``job_time_limit_exceeded``. The worker is then free for
the next batch, well before the visibility timeout would hand the messages to another worker.

Weight updates (workers/weight_sync.py): each batch runs inside ``weight_sync.batch()``, which
loads a pending target first and holds the weights still until the batch ends; a worker that may
not serve (paused, or the target failed to load here) hands the batch back to the queue. Between
decode steps, ``weight_sync.interruption()`` stops the rows in flight for an update in mode
``abort`` (they end with ``finish_reason: "abort"`` and their tokens so far) or ``retract`` (their
jobs go back to the queue and run again from the prompt on the new weights).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from typing import Any

import redis
from celery import shared_task

from engine.errors import HandleUnavailableError, JobTimeoutError, RolloutError
from workers.celery_app import SHARED_GENERATE_QUEUE
from workers.gpu_batching import REQUEUE, GenerateBatches
from workers.job_store import TERMINAL
from workers.lifecycle import end_jobs, fail_job, fail_unexpected, resume_followups
from workers.logs import job_context
from workers.metrics import count, observe_stage
from workers.prompt_codec import open_prompt, release_prompt
from workers.redis_client import REDIS_DOWN
from workers.runtime import runtime
from workers.submission import GENERATE_TASK, enqueue_preprocess

log = logging.getLogger(__name__)

ABORT_POLL_SECONDS = 0.05
# How long a batch waits for a paused or failed worker to serve again before its messages go back.
WEIGHTS_HOLD_SECONDS = 2.0
REDIS_DOWN_POLL_PAUSE_SECONDS = 1.0


@shared_task(name="rollout.generate", base=GenerateBatches, bind=True, flush_every=16, flush_interval=0.005)
def generate(self, requests) -> str | None:
    rt = runtime(self.app)
    job_ids = list(dict.fromkeys(request.args[0] for request in requests))
    with job_context(*job_ids):
        try:
            return _generate(rt, job_ids)
        except REDIS_DOWN:
            log.warning("Redis unavailable during a batch of %d jobs; their messages go back to the queue",
                        len(job_ids))
            return REQUEUE


def _generate(rt, job_ids: list[str]) -> str | None:
    try:
        engine = rt.wait_for_model()
    except Exception:
        for job_id in job_ids:
            fail_unexpected(rt, job_id, "loading the model")
        return None
    with rt.weight_sync.batch(WEIGHTS_HOLD_SECONDS) as may_serve:
        if not may_serve:
            return REQUEUE  # paused, or the fleet's weights did not load here: another worker (or later)
        _generate_batch(rt, engine, job_ids)
    return None


def _generate_batch(rt, engine, job_ids: list[str]) -> None:
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
    ready, ended = [], []
    for job_id, job, raw in zip(job_ids, jobs, prompts, strict=True):
        if job is None:
            continue
        if job["status"] in TERMINAL:
            ended.append(job)
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
    resume_followups(rt, ended)
    moved = rt.jobs.advance_many([(job["id"], job["owner"]) for job, _ in ready], "generating")
    running = []
    for (job, prompt), advanced in zip(ready, moved, strict=True):
        # Neither moved nor already generating (a redelivery): it was cancelled meanwhile.
        if advanced or job["status"] == "generating":
            running.append((job, prompt))
        else:
            release_prompt(rt.redis, prompt)
    ready = running
    retracted: set[str] = set()  # jobs requeued by a weight update: their features stay held
    try:
        for kind in ("generate", "score"):
            group = [(job, prompt) for job, prompt in ready if job["kind"] == kind]
            if group:
                _run_group(rt, engine, kind, group, deadline, retracted)
    finally:
        for job, prompt in ready:
            if job["id"] not in retracted:
                release_prompt(rt.redis, prompt)


def _run_group(rt, engine, kind: str, group: list[tuple[dict, Any]], deadline: float, retracted: set[str]) -> None:
    """Run ``group`` as one engine batch and end its jobs. Raises only for a group of one."""
    started = time.perf_counter()
    timed_out: set[int] = set()
    stopped: dict[int, str] = {}  # row -> "abort" | "retract": stopped for a weight update or pause
    try:
        outputs = _run_engine(rt, engine, kind, group, deadline, timed_out, stopped)
    except REDIS_DOWN:
        raise  # an outage, not a request's fault: the batch is requeued
    except Exception:
        if len(group) == 1:
            raise
        # One bad request must not fail its batch mates, whatever it raised (a typed error, or an
        # IndexError, a shape mismatch, out of memory...): split the batch in halves and run each.
        # A lone bad row then costs about 2·log2(n) runs, where one run per row would cost n.
        half = len(group) // 2
        for part in (group[:half], group[half:]):
            _run_part(rt, engine, kind, part, deadline, retracted)
        return
    elapsed = time.perf_counter() - started
    observe_stage(rt.redis, kind, elapsed)
    endings = []
    interrupted = 0
    for index, ((job, prompt), output) in enumerate(zip(group, outputs, strict=True)):
        aborted = kind == "generate" and any(choice.finish_reason == "abort" for choice in output.choices)
        if index in timed_out and aborted:
            limit = rt.settings.task_soft_time_limit
            fail_job(rt, job["id"], JobTimeoutError(f"generation exceeded its time limit ({limit} s)"))
        elif index in stopped and aborted and stopped[index] == "retract":
            interrupted += 1
            _retract(rt, job, prompt)
            retracted.add(job["id"])
        else:
            if index in stopped and aborted:
                interrupted += 1
            endings.append(_ending(rt, engine, job, prompt, output, elapsed, batch_size=len(group),
                                   stopped_by_weights=index in stopped))
    end_jobs(rt, endings)
    if interrupted:
        rt.weight_sync.note_interrupted(interrupted)


def _retract(rt, job: dict, prompt) -> None:
    """Queue the job again: it runs from its prompt on the new weights (its message is acknowledged
    with this batch, so this message is its only one). Feature handles stay on this node."""
    queue = rt.settings.generate_queue if prompt.transport != "inline" else SHARED_GENERATE_QUEUE
    rt.celery.send_task(GENERATE_TASK, args=[job["id"]], queue=queue)


def _run_part(rt, engine, kind: str, part, deadline: float, retracted: set[str]) -> None:
    """``_run_group`` on part of a failed batch; a lone request that fails alone fails its job."""
    if len(part) > 1:
        _run_group(rt, engine, kind, part, deadline, retracted)
        return
    job_id = part[0][0]["id"]
    try:
        _run_group(rt, engine, kind, part, deadline, retracted)
    except REDIS_DOWN:
        raise
    except RolloutError as error:
        fail_job(rt, job_id, error)
    except Exception:
        fail_unexpected(rt, job_id, "generating")


def _run_engine(rt, engine, kind: str, group, deadline: float, timed_out: set[int], stopped: dict[int, str]):
    """The engine's outputs; fills ``timed_out`` with the rows stopped by the batch deadline and
    ``stopped`` with those stopped for a weight update or pause (row -> mode)."""
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
        mode = rt.weight_sync.interruption()  # no Redis call: the weight watcher keeps it fresh
        if mode is not None and len(aborted) < len(job_ids):
            stopped.update((i, mode) for i in range(len(job_ids)) if i not in aborted)
            aborted.update(stopped)
        return aborted

    return engine.generate(requests, should_abort=should_abort)


def sampling_params(params: dict[str, Any]):
    """The engine's SamplingParams from a stored request's ``sampling_params``: every key the
    API accepts has a field (a job stored before a knob existed gets that knob's default)."""
    from engine.sampling import SamplingParams

    return SamplingParams(
        max_tokens=params["max_tokens"], temperature=params["temperature"], top_p=params["top_p"],
        top_k=max(params["top_k"], 0), min_p=params["min_p"], n=params["n"], seed=params.get("seed"),
        stop_token_ids=tuple(params.get("stop_token_ids") or ()), ignore_eos=params["ignore_eos"],
        logprobs=params["logprobs"],
        **{name: params[name] for name in _SAMPLING_KNOBS if name in params},
    )


_SAMPLING_KNOBS = ("stop", "include_stop_str_in_output", "min_tokens", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "top_logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens",
                   "spaces_between_special_tokens")


def _ending(rt, engine, job: dict, prompt, output, elapsed: float, *, batch_size: int,
            stopped_by_weights: bool = False):
    """``(job, status, fields)`` that end a job with its engine output (see ``end_jobs``). A row
    stopped by a weight update in mode abort succeeds with ``finish_reason: "abort"`` (the job was
    not cancelled: it ended early with its tokens so far)."""
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
        if output.prompt_logprobs is not None:
            result.update(prompt_logprobs=output.prompt_logprobs, prompt_top_logprobs=output.prompt_top_logprobs)
        if any(choice["finish_reason"] == "abort" for choice in choices) and not stopped_by_weights:
            status = "cancelled"
    return job, status, {"result": result}
