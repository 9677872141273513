"""Requests living through a weight swap (update mode ``keep``, SGLang's ``in_place``), for the
scheduler (:meth:`engine.scheduler.Scheduler.weights_changed`): the swap lands between two steps,
and every request goes on from where it was under the new weights. An in-place update of one LoRA
adapter in mode keep is the same crossing for that adapter's requests alone
(:meth:`engine.scheduler.Scheduler.replace_adapter`): they go on under its new version, the base's
and other adapters' rows untouched.

- A running row keeps its KV blocks: its prompt and earlier tokens stay as the old weights computed
  them, and its next tokens are the new weights' forward attending to that cache, unless the caller
  asked ``recompute_kv``: then its whole sequence so far is prefilled again by the new weights
  (SGLang's retract, without the wait in a queue; a request's rows share its prompt's new blocks
  as they shared the old, so it takes no more of the pool than admission counted), and its
  continuation is the new weights' forward over the whole sequence. Its decoder records the version from its next token on
  (:mod:`engine.row_versions`).
- A row whose request bounds its staleness (``max_policy_lag``) and would cross one update more
  ends here, ``finish_reason`` "policy_lag", before any token of the new weights.
- Requests not yet running (pending, admitted, a long prompt part way through its chunks) have
  computed nothing a token depends on: they are renamed under the new version and their prefill
  (re)starts under the new weights.

Prefix-cache correctness: the swap already forgot every block name (``Engine.forget_cached``);
every request here is renamed under the new version (:func:`engine.scheduled_requests.rekey`), so
a block computed by old weights is never found by a request of the new ones, and a row whose KV
mixes versions names none of its blocks when it ends (:meth:`engine.prefix_cache.PrefixCache.keep_decoded`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.prefill_plan import reusable_blocks
from engine.prefix_cache import PrefixCache
from engine.row_versions import RowVersions
from engine.running_batch import RunningBatch
from engine.scheduled_requests import Job
from engine.step_prefill import StepPrefill
from engine.step_runner import PromptInput, StepRunner


def cross_swap(jobs: Iterable[Job], batch: RunningBatch, prefill: StepPrefill, admitted: list[Job],
               prefixes: PrefixCache, runner: StepRunner, *, mark: Callable[[RowVersions, int], None],
               recompute_kv: bool, rename: Callable[[Job], None],
               fail: Callable[[Job, BaseException], None]) -> list[Job]:
    """Carry ``jobs`` (every request of the scheduler for a swap of the base; those of one adapter
    for an in-place update of it) across the swap, ``mark`` naming what makes a row's tokens from
    a given one on; returns the scheduler's admitted jobs (a long prompt of ``jobs`` part way through
    its chunks goes back among them, first)."""
    jobs = list(jobs)
    crossing = {id(job) for job in jobs}
    chunking = prefill.chunking_job
    if chunking is not None and chunking.state != "done" and id(chunking) in crossing:
        prefill.stop_chunking()  # its chunks so far are the old weights': it starts again
        admitted = [chunking, *admitted]
    for job in jobs:
        prefixes.drop(job)  # cached blocks an admitted prompt held: the old weights'
        rename(job)
        for row in job.rows:
            if not row.done and not row.token_ids:
                mark(row.versions, 0)  # not running yet: its first token is the new weights'
            elif not row.done and job.resuming:  # preempted: its resume computes its KV with the new weights
                _cross(row, mark)
                row.versions.recomputed += 1
    rows = [i for i, job in enumerate(batch.jobs) if id(job) in crossing]
    for i in rows:
        _cross(batch.rows[i], mark)
    if recompute_kv:
        _recompute(batch, [i for i in rows if not batch.rows[i].done], runner, fail)
    batch.drop_finished()  # rows ended for their lag leave (naming none of their blocks)
    return admitted


def _cross(row, mark: Callable[[RowVersions, int], None]) -> None:
    """A row with tokens lives through the swap, or ends for its ``max_policy_lag``."""
    row.versions.crossed += 1
    lag = row.params.max_policy_lag
    if lag is not None and row.versions.crossed > lag:
        row.abort("policy_lag")
    else:
        mark(row.versions, len(row.token_ids))


def _recompute(batch: RunningBatch, indices: list[int], runner: StepRunner,
               fail: Callable[[Job, BaseException], None]) -> None:
    """The KV of the running rows at ``indices`` computed again by the weights serving now, into
    new blocks: each request's prompt once (one forward for all), then each row's tokens in the
    cache after its prompt's full blocks, which its rows share as they did (a second forward); the
    token a row feeds next is not in its cache."""
    if not indices:
        return
    pool, size = batch.pool, batch.pool.block_size
    jobs = list({id(batch.jobs[i]): batch.jobs[i] for i in indices}.values())
    for i in indices:
        pool.release(batch.tables[i])
        batch.tables[i] = []
    prompts = []
    try:
        prompts = runner.prefill([PromptInput(job.request.prompt_token_ids, job.features, job.units, adapter=job.adapter)
                                  for job in jobs])
        by_job = {id(job): prompt for job, prompt in zip(jobs, prompts, strict=True)}
        inputs = []
        for i in indices:
            row, job, length = batch.rows[i], batch.jobs[i], batch.lengths[i]
            shared = reusable_blocks(job.prompt_len // size, size, length, [unit.span for unit in job.units])
            prefix = by_job[id(job)].kv.blocks[:shared]
            pool.share(prefix)  # the row's prefill takes this reference over
            inputs.append(PromptInput([*job.request.prompt_token_ids, *row.token_ids][:length], job.features,
                                      job.units, prefix, shared * size, job.adapter))
        rows = runner.prefill(inputs)
    except Exception as error:  # their KV is gone: the requests end with the error
        for job in jobs:
            fail(job, error)
        return
    finally:
        for prompt in prompts:
            prompt.kv.release()
    for i, prompt in zip(indices, rows, strict=True):
        batch.tables[i], prompt.kv.blocks = prompt.kv.blocks, []  # the row takes the prompt's reference
        batch.rows[i].versions.recomputed += 1
