"""The GPU worker's jobs and the engine, both ways: open a batch's jobs (prompt handles, status to
``generating``), a stored request's sampling parameters, score a group of jobs, and the fields a
job ends with. Used by the GPU session (``workers/gpu/session.py``); the Celery task itself lives
in ``workers/tasks/gpu.py``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from domain.infra.metrics import count, observe_stage
from domain.infra.redis_client import REDIS_DOWN
from domain.jobs.attempts import attempt_key
from domain.jobs.events import watch_key
from domain.jobs.prompt_codec import open_prompt, release_prompts
from domain.jobs.results import engine_result
from domain.jobs.store import TERMINAL, JobStore
from domain.jobs.stored_job import StoredJob
from domain.jobs.submission import enqueue_preprocess, placement, send_placed
from domain.lifecycle import end_jobs, fail_job, fail_unexpected, resume_followups
from domain.names import worker_name
from engine.errors import HandleUnavailableError, RolloutError
from workers.gpu.adapter_sync import engine_adapter
from workers.memory_refusal import refused_for_memory

log = logging.getLogger(__name__)


def open_jobs(rt, job_ids: list[str], *, device, holder: str = "") -> tuple[list[tuple[StoredJob, Any]], list[str]]:
    """The jobs of ``job_ids`` that are ready to run, moved to ``generating``, with their opened
    prompts and, for a generate job, its new attempt (``StoredJob.attempt``, begun for ``holder``,
    this worker's heartbeat key); and the ids settled without running (gone, already ended, sent
    back to preprocessing, cancelled meanwhile, or run by another live worker's attempt), whose
    messages are done."""
    ready, ended, settled = [], [], []
    for job_id, (record, raw) in zip(job_ids, rt.jobs.with_prompts(job_ids), strict=True):
        if record is None:
            settled.append(job_id)
            continue
        job = StoredJob.of(record)
        if job.status in TERMINAL:
            ended.append(record)
            settled.append(job_id)
            continue
        if raw is None:
            enqueue_preprocess(rt.celery, job_id, retry_handles=True)
            settled.append(job_id)
            continue
        try:
            prompt = open_prompt(json.loads(raw), device=device)
        except HandleUnavailableError:
            # The producer died or its pool reclaimed the memory: preprocess again (cheap with the
            # multimodal cache) rather than fail the job.
            log.info("job %s: feature handles unavailable; preprocessing again", job_id)
            count(rt.redis, "handle_unavailable")
            enqueue_preprocess(rt.celery, job_id, retry_handles=True)
            settled.append(job_id)
            continue
        ready.append((job, prompt))
    resume_followups(rt, ended)
    moved = rt.jobs.advance_many([(job.id, job.owner) for job, _ in ready], "generating")
    running, cancelled = [], []
    for (job, prompt), advanced in zip(ready, moved, strict=True):
        # Neither moved nor already generating (a redelivery): it was cancelled meanwhile.
        if advanced or job.status == "generating":
            running.append((job, prompt))
        else:
            cancelled.append(prompt)
            settled.append(job.id)
    release_prompts(rt.redis, cancelled)
    generating = [job.id for job, _ in running if job.kind == "generate"]
    attempts = dict(zip(generating, rt.events.begin_attempts(generating, holder=holder), strict=True))
    opened = []
    for job, prompt in running:
        attempt = attempts.get(job.id)
        if job.kind == "generate" and attempt is None:
            # Ended meanwhile, or a duplicate of a message another live worker runs (it was handed
            # back while that worker seemed dead): that attempt ends the job, and uses its prompt.
            log.info("job %s: run by another attempt; this message is a duplicate", job.id)
            settled.append(job.id)
            continue
        opened.append((job.began(attempt), prompt))
    return opened, settled


def poll_running(redis, running: list[str], unwatched: list[str]) -> tuple[set[str], set[str]]:
    """The jobs of ``running`` asked to stop, and those of ``unwatched`` that got a reader: their
    cancel and watch flags in one MGET (the session polls it at most every ``ABORT_POLL_SECONDS``)."""
    polled = poll_session(redis, {}, running, unwatched)
    return polled.cancelled, polled.watched


@dataclass(frozen=True)
class Polled:
    cancelled: set[str]  # asked to stop
    watched: set[str]  # got a reader
    superseded: set[str]  # a newer attempt began elsewhere: this one no longer owns the job


def poll_session(redis, attempts: dict[str, int], running: list[str], unwatched: list[str]) -> Polled:
    """``poll_running``, and which of ``attempts`` (job id: this session's attempt) a newer attempt
    superseded (this worker seemed dead for a while and its messages ran elsewhere), in the same MGET."""
    keys = ([JobStore.cancel_key(job_id) for job_id in running] + [watch_key(job_id) for job_id in unwatched]
            + [attempt_key(job_id) for job_id in attempts])
    flags = redis.mget(keys) if keys else []
    cancel_flags, rest = flags[:len(running)], flags[len(running):]
    watch_flags, newest = rest[:len(unwatched)], rest[len(unwatched):]
    return Polled(
        cancelled={job_id for job_id, flag in zip(running, cancel_flags, strict=True) if flag},
        watched={job_id for job_id, flag in zip(unwatched, watch_flags, strict=True) if flag},
        superseded={job_id for (job_id, attempt), number in zip(attempts.items(), newest, strict=True)
                    if number is not None and int(number) != attempt})


def run_score_jobs(rt, engine, group: list[tuple[StoredJob, Any]]) -> None:
    deadline = time.monotonic() + rt.settings.task_soft_time_limit
    _run_part(rt, engine, "score", group, deadline)


def _run_group(rt, engine, kind: str, group: list[tuple[StoredJob, Any]], deadline: float) -> None:
    """Run ``group`` as one scoring batch and end its jobs. Raises only for a group of one."""
    from engine.scoring import ScoreRequest

    started = time.perf_counter()
    try:
        outputs = engine.score([
            ScoreRequest(prompt_token_ids=prompt.token_ids, items=prompt.items,
                         completion_token_ids=job.request.completion_token_ids,
                         adapter=engine_adapter(job.adapter_id, engine.adapter_ids),
                         routed_experts=job.request.sampling.routed_experts)
            for job, prompt in group
        ])
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
            _run_part(rt, engine, kind, part, deadline)
        return
    elapsed = time.perf_counter() - started
    observe_stage(rt.redis, kind, elapsed)
    end_jobs(rt, [ending(rt, engine, job, prompt, output, elapsed, batch_size=len(group))
                  for (job, prompt), output in zip(group, outputs, strict=True)])


def _run_part(rt, engine, kind: str, part, deadline: float) -> None:
    """``_run_group`` on part of a failed batch; a lone request that fails alone fails its job."""
    if len(part) > 1:
        _run_group(rt, engine, kind, part, deadline)
        return
    job_id = part[0][0].id
    try:
        _run_group(rt, engine, kind, part, deadline)
    except REDIS_DOWN:
        raise
    except RolloutError as error:
        fail_job(rt, job_id, error)
    except Exception as error:
        if refused_for_memory(rt.redis, error):
            raise  # Redis at its maxmemory refused the end: the session hands the job back, unfailed
        fail_unexpected(rt, job_id, "generating")


def requeue_generate(rt, job: StoredJob, prompt) -> None:
    """Queue the job's generation again (a weight update in mode retract): it runs from its prompt,
    on the new weights, most likely on this worker (its prefix is here); its feature handles stay
    held on this node."""
    media = [(item.offset[0], item.content_hash) for item in prompt.items if item.content_hash]
    send_placed(rt.celery, rt.redis, [
        placement(job.id, job.owner, job.request, prompt.token_ids, media=media,
                  transport=prompt.transport, node_id=rt.settings.node_id)])


def ending(rt, engine, job: StoredJob, prompt, output, elapsed: float, *, batch_size: int,
           stopped_by_weights: bool = False):
    """``(job record, status, fields)`` that end a job with its engine output (see ``end_jobs``). A row
    stopped by a weight update in mode abort succeeds with ``finish_reason: "abort"`` (the job was
    not cancelled: it ended early with its tokens so far)."""
    timings = {**prompt.timings, **(getattr(output, "timings", None) or {}), job.kind: elapsed,
               "batch_size": batch_size}
    result = engine_result(output, kind=job.kind, prompt_token_ids=prompt.token_ids,
                           placeholder_ranges=prompt.placeholder_ranges, weight_version=engine.weight_version,
                           transport=prompt.transport, timings=timings,
                           # Handles never cross nodes: where the prompt was preprocessed and where it ran.
                           nodes={"preprocess": prompt.node_id, "generate": rt.settings.node_id,
                                  "generate_worker": worker_name(rt.settings.node_id)})
    aborted = any(choice["finish_reason"] == "abort" for choice in result.get("choices", ()))
    return job.record, "cancelled" if aborted and not stopped_by_weights else "succeeded", {"result": result}
