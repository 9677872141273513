"""Preemption for the scheduler (:mod:`engine.scheduler`): which running request gives way to a key
below its share of the batch, and how it comes back.

A preempted request keeps everything but its KV blocks: its rows leave the running batch with
their tokens, decoders (penalties, seeded generators) and deadline's time left, and it waits
among the pending requests in its place. When admitted again, its rows' KV is computed again
(:func:`resume`: the prompt once, from the blocks cached by name, then each row's tokens after the
prompt's full blocks, as :mod:`engine.weight_crossing` does for ``recompute_kv``) and they decode
on from their last token. vLLM's recompute preemption, where the job used to end and run again
from its prompt: each turn lost all of its tokens, and a key sending a short job a second kept
preempting another key's job that never got to finish (issue #56).

What a preemption costs the request is then bounded: the wait while the other key's request
runs, no longer than what it had left itself (:func:`preemptible`), and one prefill of its last
part blocks. A request that resumed is not chosen again until its rows made
:data:`PROGRESS_BEFORE_PREEMPTION` tokens more (a trickle of another key's jobs moves it forward
between them, never back), and at most :data:`MAX_PREEMPTIONS` times in all.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from engine.capacity import RowFuture, SchedulerLimits, dominant_share, fair_share_victim
from engine.prefill_plan import reusable_blocks
from engine.prefix_cache import PrefixCache
from engine.prefix_hash import MediaSpan, chain
from engine.running_batch import RunningBatch
from engine.scheduled_requests import EngineStats, Job
from engine.step_runner import PromptInput, StepRunner

# Tokens a resumed request's rows decode before it may be preempted again: one KV block of the
# default size, so what its resume computed again is at least paid back.
PROGRESS_BEFORE_PREEMPTION = 16
# Times one request gives way at most: then the other key waits for rows to end.
MAX_PREEMPTIONS = 4


def progress(job: Job) -> int:
    """Its longest row's tokens so far."""
    return max((len(row.token_ids) for row in job.rows), default=0)


def preemptible(job: Job, waiting: Job) -> bool:
    """Whether ``job`` may give way to ``waiting``: running, preempted fewer than
    :data:`MAX_PREEMPTIONS` times and never since it resumed until :data:`PROGRESS_BEFORE_PREEMPTION`
    tokens more, and with at least as many steps left as ``waiting`` may take (what it waits for
    ``waiting``'s rows is at most what it had left: a long job waits for rows to end instead)."""
    if job.state != "running" or job.preemptions >= MAX_PREEMPTIONS:
        return False
    if job.preemptions and progress(job) - job.resume_mark < PROGRESS_BEFORE_PREEMPTION:
        return False
    return job.request.sampling.max_tokens - progress(job) >= waiting.request.sampling.max_tokens


def choose_victim(waiting: Job, jobs: list[Job], limits: SchedulerLimits, usage: Mapping[Any, float],
                  peak_blocks: Callable[[Job], int]) -> Job | None:
    """The running request that gives way to ``waiting``'s tenant (:func:`engine.capacity.fair_share_victim`
    over the preemptible ones), or None. ``jobs``: every live request; ``usage``: each tenant's recent use."""
    live = [job for job in jobs if job.state != "done"]
    tenants = len({job.request.tenant for job in live})
    if tenants < 2:  # a key alone keeps the whole batch (and the common case costs one pass)
        return None
    holding = [job for job in live if job.state in ("admitted", "running")]
    peak = {job.handle: peak_blocks(job) for job in [*holding, waiting]}
    rows, blocks = Counter(), Counter()
    for job in holding:
        rows[job.request.tenant] += len(job.rows)
        blocks[job.request.tenant] += peak[job.handle]
    shares = {tenant: dominant_share(rows[tenant], blocks[tenant], limits) for tenant in rows}
    running = sorted((job for job in holding if preemptible(job, waiting)), key=lambda job: job.admitted_at)
    victim = fair_share_victim(
        waiting.request.tenant, dominant_share(len(waiting.rows), peak[waiting.handle], limits), shares,
        [(job.request.tenant, dominant_share(len(job.rows), peak[job.handle], limits)) for job in running],
        tenants=tenants, usage=usage)
    return None if victim is None else running[victim]


def resume_rows(job: Job, block_size: int) -> list[RowFuture]:
    """A preempted job's rows as admission weighs them: each as long as it was (not from its prompt)."""
    shared = job.prompt_len // block_size
    return [RowFuture(job.prompt_len + len(row.token_ids), row.params.max_tokens - len(row.token_ids), job.handle,
                      shared) for row in job.rows if not row.done]


def preempt(job: Job, batch: RunningBatch, stats: EngineStats) -> None:
    """``job``'s rows leave the batch with their tokens (its KV blocks go back); it waits to resume."""
    batch.evict(job)
    job.state, job.resuming = "pending", True
    job.preemptions += 1
    if job.deadline is not None:
        job.time_left, job.deadline = max(0.0, job.deadline - time.monotonic()), None
    stats.preempted_requests += 1


def resume(job: Job, batch: RunningBatch, runner: StepRunner, prefixes: PrefixCache, stats: EngineStats, *,
           fail: Callable[[Job, BaseException], None]) -> None:
    """A preempted ``job`` admitted again: its rows' KV computed again and the rows back in the
    batch, each to feed its last token next. A prefill that raises ends the job with its error."""
    pool, size = batch.pool, batch.pool.block_size
    rows = [row for row in job.rows if not row.done]
    job.resuming, job.state, job.resume_mark = False, "running", progress(job)
    if job.time_left is not None:
        job.deadline, job.time_left = time.monotonic() + job.time_left, None
    held = []
    try:
        prompt = prefixes.find(job)  # the prompt found whole in the pool, or the cached blocks it starts from
        if prompt is None:
            [prompt] = runner.prefill([PromptInput(job.request.prompt_token_ids, job.features, job.units,
                                                   job.prefix, job.prefix_tokens, job.adapter)])
            stats.prefill_tokens += prompt.length - job.prefix_tokens
            job.prefix, job.prefix_tokens = [], 0
            prefixes.keep(job, prompt)
        held.append(prompt)
        inputs = []
        for row in rows:
            length = job.prompt_len + len(row.token_ids) - 1  # its last token is fed by the next decode step
            tokens = [*job.request.prompt_token_ids, *row.token_ids][:length]
            shared = reusable_blocks(job.prompt_len // size, size, length, [unit.span for unit in job.units])
            prefix = prompt.kv.blocks[:shared]
            decoded = _decoded_blocks(job, tokens, pool) if shared == job.prompt_len // size else []
            count = reusable_blocks(len(decoded), size, length, []) if decoded else 0
            prefix = [*prefix, *decoded[shared:count]]
            pool.share(prefix)  # the row's prefill takes this reference over
            inputs.append(PromptInput(tokens, job.features, job.units, prefix, len(prefix) * size, job.adapter))
            stats.prefill_tokens += length - len(prefix) * size
        held.remove(prompt)  # the rows hold its full blocks now: the rest (its tail) is free for their own
        prompt.kv.release()
        prefilled = runner.prefill(inputs) if inputs else []
        held += prefilled
        if rows:
            last = torch.tensor([row.token_ids[-1] for row in rows], dtype=torch.long)
            batch.join(rows, [job] * len(rows), prefilled, last)
    except Exception as error:  # its KV is gone: the request ends with the error
        prefixes.drop(job)
        fail(job, error)
    finally:  # the rows that joined hold their blocks; the prefills' own references go back
        for prompt in held:
            prompt.kv.release()


def _decoded_blocks(job: Job, tokens: list[int], pool) -> list[int]:
    """The blocks of ``tokens`` (a row's prompt and tokens) the pool still holds by name, from the
    first: its prompt's full blocks, then those its row named as it left
    (:meth:`engine.prefix_cache.PrefixCache.keep_decoded`), while the pool has not reused them."""
    names, size = job.names, pool.block_size
    if names is None:
        return []
    first = len(names.full)
    parent = names.full[-1] if names.full else names.root
    spans = [MediaSpan(*unit.span, unit.key) for unit in job.units]
    return pool.cached_run([*names.full, *chain(parent, tokens, size, spans, first_block=first)])
