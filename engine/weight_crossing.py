"""Requests living through a weight swap (update mode ``keep``, SGLang's ``in_place``), for the
scheduler (:meth:`engine.scheduler.Scheduler.weights_changed`): the swap lands between two steps,
and every request goes on from where it was under the new weights.

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
from engine.running_batch import RunningBatch
from engine.scheduled_requests import Job
from engine.step_prefill import StepPrefill
from engine.step_runner import PromptInput, StepRunner


def cross_swap(version: str, jobs: Iterable[Job], batch: RunningBatch, prefill: StepPrefill, admitted: list[Job],
               prefixes: PrefixCache, runner: StepRunner, *, recompute_kv: bool,
               rename: Callable[[Job], None], fail: Callable[[Job, BaseException], None]) -> list[Job]:
    """Carry the scheduler's requests across the swap to ``version``; returns its admitted jobs
    (a long prompt part way through its chunks goes back among them, first)."""
    chunking = prefill.chunking_job
    if chunking is not None and chunking.state != "done":
        prefill.stop_chunking()  # its chunks so far are the old weights': it starts again
        admitted = [chunking, *admitted]
    for job in jobs:
        prefixes.drop(job)  # cached blocks an admitted prompt held: the old weights'
        rename(job)
        for row in job.rows:
            if not row.done and not row.token_ids:
                row.versions.mark(0, version)  # not running yet: its first token is the new weights'
            elif not row.done and job.resuming:  # preempted: its resume computes its KV with the new weights
                _cross(row, version)
                row.versions.recomputed += 1
    for row in batch.rows:
        _cross(row, version)
    batch.drop_finished()  # rows ended for their lag leave (naming none of their blocks)
    if recompute_kv and len(batch):
        _recompute(batch, runner, fail)
    return admitted


def _cross(row, version: str) -> None:
    """A row with tokens lives through the swap to ``version``, or ends for its ``max_policy_lag``."""
    row.versions.crossed += 1
    lag = row.params.max_policy_lag
    if lag is not None and row.versions.crossed > lag:
        row.abort("policy_lag")
    else:
        row.versions.mark(len(row.token_ids), version)


def _recompute(batch: RunningBatch, runner: StepRunner, fail: Callable[[Job, BaseException], None]) -> None:
    """Every running row's KV computed again by the weights serving now, into new blocks: each
    request's prompt once (one forward for all), then each row's tokens in the cache after its
    prompt's full blocks, which its rows share as they did (a second forward); the token a row
    feeds next is not in its cache."""
    pool, size = batch.pool, batch.pool.block_size
    jobs = list({id(job): job for job in batch.jobs}.values())
    for i, table in enumerate(batch.tables):
        pool.release(table)
        batch.tables[i] = []
    prompts = []
    try:
        prompts = runner.prefill([PromptInput(job.request.prompt_token_ids, job.features, job.units, adapter=job.adapter)
                                  for job in jobs])
        by_job = {id(job): prompt for job, prompt in zip(jobs, prompts, strict=True)}
        inputs = []
        for row, job, length in zip(batch.rows, batch.jobs, batch.lengths, strict=True):
            shared = reusable_blocks(job.prompt_len // size, size, length, [unit.span for unit in job.units])
            prefix = by_job[id(job)].kv.blocks[:shared]
            pool.share(prefix)  # the row's prefill takes this reference over
            inputs.append(PromptInput([*job.request.prompt_token_ids, *row.token_ids][:length], job.features,
                                      job.units, prefix, shared * size, job.adapter))
        rows = runner.prefill(inputs)
    except Exception as error:  # their KV is gone: the requests end with the error
        for job in jobs:
            fail(job, error)
        batch.drop_finished()
        return
    finally:
        for prompt in prompts:
            prompt.kv.release()
    for i, prompt in enumerate(rows):
        batch.tables[i], prompt.kv.blocks = prompt.kv.blocks, []  # the row takes the prompt's reference
        batch.rows[i].versions.recomputed += 1
