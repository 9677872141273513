"""Iteration-level (continuous) scheduling: requests join the running batch between decode steps
and leave the moment they finish.

Why by hand: transformers' own continuous batching (``generate_batch``, ``init_continuous_batching``)
takes token ids only and drops ``pixel_values`` (transformers#43386; docs/architecture.md), so it cannot serve
a multimodal request. This module is the policy: it decides, and a :class:`engine.step_runner.StepRunner`
runs the forwards it decides on (vLLM V1's cut: its ``Scheduler`` and ``GPUModelRunner``). It reads a
model's facts (:class:`engine.model_facts.ModelFacts`) and never the model: :meth:`engine.generation.Engine.scheduler`
hands it a :class:`engine.model_runner.ModelRunner`, a test of the policy alone a runner of its own.

One :meth:`Scheduler.step`:

1. aborts and expired deadlines end their rows (a pending request ends without running);
2. one decode forward over the running rows; each row picks its token with its own
   :class:`~engine.decoding.RowDecoder` (parameters, seeded generator, penalties, stops) and
   rows that finished leave the batch, their KV blocks back in the pool at once (their full
   blocks named, so a next turn that repeats them finds them);
3. pending requests are admitted, the tenant with the least recent use first (its tokens of the
   last while, :mod:`engine.tenant_usage`; first come first served within a tenant, and for a
   tenant alone: :func:`engine.capacity.next_admission`), while the rows (``max_rows``) and the KV
   pool (``kv_cache_tokens`` in blocks of ``kv_block_tokens``: the blocks of every admitted row at
   the worst point of their futures) allow. When they do not, and the tenant is below an even
   share of the batch while another that used more lately is above it, that one's newest
   preemptible request gives way (:mod:`engine.preemption`): its rows leave with their tokens,
   its blocks go back, and it waits to resume where it was (its rows' KV computed again);
4. admitted prompts are looked up in the pool by their blocks' names (:mod:`engine.prefix_hash`):
   one found whole (every block, and its last logits) joins with no forward; the others are
   prefilled from the end of the blocks found, each distinct prompt (token ids + media keys) once,
   whatever the number of rows that share it (``n > 1``, or separate requests). Short prompts go
   together in one padded forward, at most ``prefill_chunk_tokens`` tokens computed while rows
   are decoding; a longer one is prefilled alone in chunks of that size, one chunk per step, so
   decoding rows keep their pace. A prefilled prompt's K/V is written into pool blocks and named;
   each row of the prompt takes its first token from the prompt's last logits and joins the
   running batch sharing those blocks. While rows decode, prompts to compute wait until they are
   ``join_ratio`` of the running rows, at most ``join_wait_steps`` steps
   (:func:`engine.prefill_plan.hold_joins`): one forward for several.

The parts, each testable without a model: the KV pool (:mod:`engine.paged_kv`), the running
batch (:mod:`engine.running_batch`: rows, their jobs, block tables, lengths, deltas and next tokens
as one object), admission in blocks (:func:`engine.capacity.fits_kv_pool`), the step's prefill
(:mod:`engine.step_prefill`, planned by :mod:`engine.prefill_plan`), prefix reuse
(:mod:`engine.prefix_cache`, names from :mod:`engine.prefix_hash`), what is kept per request
(:mod:`engine.scheduled_requests`), sampling (:mod:`engine.batch_sampler`) and result building
(:mod:`engine.request_result`). This module moves jobs through their states (pending -> admitted
-> running -> done) and owns their references to cached blocks until a prompt takes them over.

Positions: a row's next text position is the number of real tokens it has; M-RoPE models add the
row's rope delta (from transformers' own ``get_rope_index``), so rows of any length and media share
a batch and each sees the positions it would see alone.

Errors: a request that fails (its prefill, or its row's sampling, or a forward that goes
non-finite for it) ends alone with its error; the rest of the batch goes on. A failing decode
forward ends every running request with the error.
"""

from __future__ import annotations

import time
from bisect import insort
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from engine.batch_sampler import RowTokens, sample_step
from engine.capacity import SchedulerLimits, fits_kv_pool, next_admission, request_peak_blocks, request_rows
from engine.decoding import RowDecoder
from engine.grammar.for_request import admissible, wait_for_grammars
from engine.lora.bank import adapter_admissible
from engine.model_facts import ModelFacts
from engine.preemption import choose_victim, preempt, resume, resume_rows
from engine.prefix_cache import PrefixCache
from engine.prompt_cache import PrefilledPrompt, PromptEnds
from engine.request_checks import check_request
from engine.request_result import build_result
from engine.running_batch import RunningBatch
from engine.scheduled_requests import ChoiceSoFar, EngineStats, Finished, Job, new_job, rekey
from engine.step_prefill import StepPrefill
from engine.step_runner import StepRunner
from engine.tenant_usage import TenantUsage
from engine.weight_crossing import cross_swap

StepHook = Callable[[list[RowTokens]], None]


class Scheduler:
    """The continuous batch of one model, planned from its ``facts`` and run by ``runner`` (whose
    pool holds the KV blocks). Not thread-safe: one thread submits and steps (:meth:`abort` may be
    called from elsewhere: it only sets a flag)."""

    def __init__(self, facts: ModelFacts, runner: StepRunner, limits: SchedulerLimits | None = None, *,
                 prompt_ends: PromptEnds | None = None, stats: EngineStats | None = None,
                 on_step: StepHook | None = None, usage: TenantUsage | None = None):
        self.facts, self.runner, self.pool = facts, runner, runner.pool
        self.limits = limits = limits or SchedulerLimits()
        self.prefixes = PrefixCache(self.pool, prompt_ends if prompt_ends is not None
                                    else PromptEnds(limits.prompt_cache_tokens))
        self.stats = stats if stats is not None else EngineStats()
        self.usage = usage if usage is not None else TenantUsage(limits.usage_half_life_s)
        self.on_step = on_step
        media = sorted(t for t in facts.media_token_ids.values() if 0 <= t < facts.vocab_size)
        self._placeholder_ids = torch.tensor(media, dtype=torch.long) if media else None
        self._next_handle = 0
        self._jobs: dict[int, Job] = {}
        self._pending: list[Job] = []
        self._admitted: list[Job] = []  # admitted, waiting for their prompt's prefill
        self._replaced: deque[tuple[str, str, bool]] = deque()  # adapters updated in place in mode keep
        self._batch = RunningBatch(self.pool, attn_implementation=self.runner.attn_implementation,
                                   dtype=facts.dtype, device=facts.device, on_row_done=self.prefixes.keep_decoded)
        self._prefill = StepPrefill(runner, self.prefixes, self.stats, limits, fail=self._fail)

    # --- submitting ---------------------------------------------------------------------------

    def check(self, request) -> dict[str, torch.Tensor]:
        """Refuse what can never run (typed errors); the request's model features otherwise."""
        return check_request(self.facts, self.limits, getattr(self.runner, "routing", None), request)

    def submit(self, request, *, tag: Any = None, time_limit: float | None = None,
               features: dict[str, torch.Tensor] | None = None) -> int:
        """Queue ``request`` (an ``engine.generation.GenerationRequest``); returns its handle.
        ``time_limit``: seconds from its admission (not its wait); its rows stop then and it ends
        ``timed_out``."""
        if features is None:
            features = self.check(request)
        handle = self._next_handle
        self._next_handle += 1
        job = new_job(self.facts, handle, tag, request, features, time_limit, block_size=self.pool.block_size,
                      prefix_caching=self.limits.prefix_caching)
        self._jobs[handle] = job
        self._pending.append(job)
        return handle

    def tokens_so_far(self, handle: int) -> list[ChoiceSoFar]:
        """Each choice of the request with its tokens so far: what a stream that starts mid-request
        sends first. Empty once the request ended."""
        job = self._jobs.get(handle)
        return [] if job is None else [ChoiceSoFar(row.choice_index, list(row.token_ids), row.logprobs(),
                                                   row.finish_reason) for row in job.rows]

    def abort(self, handle: int) -> None:
        """End the request at the next step with the tokens so far (``finish_reason="abort"``)."""
        job = self._jobs.get(handle)
        if job is not None:
            job.abort_requested = True

    def abort_adapter(self, adapter_id: str) -> int:
        """:meth:`abort` every request under the LoRA adapter ``adapter_id``; how many."""
        jobs = [job for job in list(self._jobs.values()) if job.adapter == adapter_id]
        for job in jobs:
            job.abort_requested = True
        return len(jobs)

    def weights_changed(self, *, recompute_kv: bool = False) -> None:
        """The model's weights were just swapped between two steps (update mode keep): every request
        goes on under them (:func:`engine.weight_crossing.cross_swap`)."""
        version = self.facts.weight_version
        self._cross(list(self._jobs.values()), lambda versions, tokens: versions.mark(tokens, version), recompute_kv)

    def replace_adapter(self, old: str, new: str, *, recompute_kv: bool = False) -> None:
        """The LoRA adapter ``old`` was updated in place as ``new`` (mode keep): ``old``'s requests
        go on under ``new`` from their next token, as every request does across a swap of the base;
        the other adapters' and the base's never notice. Safe from another thread: applied at the
        next step, between two forwards (``new`` must be loaded already)."""
        self._replaced.append((old, new, recompute_kv))

    def _replace_adapters(self) -> None:
        while self._replaced:
            old, new, recompute_kv = self._replaced.popleft()
            jobs = [job for job in self._jobs.values() if job.adapter == old]
            for job in jobs:
                job.request = replace(job.request, adapter=new)
            self._cross(jobs, lambda versions, tokens, _new=new: versions.mark(tokens, adapter=_new), recompute_kv)

    def _cross(self, jobs: list[Job], mark, recompute_kv: bool) -> None:
        size, caching = self.pool.block_size, self.limits.prefix_caching
        self._admitted = cross_swap(
            jobs, self._batch, self._prefill, self._admitted, self.prefixes, self.runner, mark=mark,
            recompute_kv=recompute_kv, fail=self._fail,
            rename=lambda job: rekey(self.facts, job, block_size=size, prefix_caching=caching))

    @property
    def adapters_in_use(self) -> set[str]:
        """The LoRA adapters its requests run under (engine/lora/: a retired one is kept for them)."""
        return {job.adapter for job in self._jobs.values() if job.adapter}

    @property
    def has_work(self) -> bool:
        return bool(self._jobs)

    @property
    def running_rows(self) -> int:
        return len(self._batch)

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        return len(self._pending)

    @property
    def free_rows(self) -> int:
        """Rows a new request could take now."""
        return max(0, self.free_rows_for_admission - sum(len(j.rows) for j in self._pending))

    @property
    def intake_room(self) -> int:
        """How many more requests the caller may submit now: two batches' worth wait here at most.
        Every tenant among them is seen by admission (and may preempt), where requests held back
        outside until rows were free would wait behind one tenant's backlog in arrival order."""
        return max(0, 2 * self.limits.max_rows - len(self._pending))

    def close(self) -> None:
        """Give every KV block this scheduler holds back to the pool and drop its requests: a
        scheduler left with rows running (its session ended by an outage or an error) must not
        keep the engine's memory."""
        self._prefill.release_step()
        for job in self._jobs.values():
            for row in job.rows:
                row.abort()
            self.prefixes.drop(job)
        self._batch.drop_finished()
        self._jobs.clear()
        self._prefill.stop_chunking()
        self._pending, self._admitted = [], []

    # --- one step -----------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """One scheduling iteration (see the module docstring); the requests that ended in it."""
        events: list[RowTokens] = []
        self._replace_adapters()
        self._stop_aborted_and_expired()
        if self._batch:
            self._decode(events)
        elif not self._admitted_or_chunking():
            wait_for_grammars(self._pending)  # all that waits is a compile: wait on it, not spin
        self._admit()
        self._prefill_and_join(events)
        self._batch.drop_finished()
        finished = self._collect()
        if self.on_step is not None and events:
            self.on_step(events)
        return finished

    def _stop_aborted_and_expired(self) -> None:
        now = time.monotonic()
        for job in list(self._jobs.values()):
            expired = job.deadline is not None and now >= job.deadline
            if not (job.abort_requested or expired) or job.state == "done":
                continue
            job.timed_out = job.timed_out or (expired and not job.abort_requested)
            for row in job.rows:
                row.abort()
        self._batch.drop_finished()

    def _decode(self, events: list[RowTokens]) -> None:
        batch = self._batch
        try:
            logits = self.runner.decode(batch)
        except Exception as error:  # a batch forward: every running request ends with it
            for job in {id(job): job for job in batch.jobs}.values():
                self._fail(job, error)
            batch.drop_finished()
            return
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(batch)
        self.stats.kv_live_tokens += batch.live_tokens + len(batch)
        self.stats.kv_held_tokens += self.pool.in_use * self.pool.block_size
        self.stats.kv_read_tokens += len(batch) * (max(batch.lengths) + 1)
        self.usage.charge_rows(job.request.tenant for job in batch.jobs)
        tokens = self._sample(batch.rows, batch.jobs, logits, events, batch_rows=len(batch))
        batch.advance(tokens)

    def _sample(self, rows: Sequence[RowDecoder], jobs: Sequence[Job], logits: torch.Tensor,
                events: list[RowTokens], *, batch_rows: int) -> torch.Tensor:
        return sample_step(rows, jobs, logits, placeholder_ids=self._placeholder_ids, events=events,
                           batch_rows=batch_rows, fail=self._fail)

    def _admit(self) -> None:
        if not self._pending:
            return
        held = Counter(job.request.tenant for job in self._batch.jobs)  # a row each
        for admitted in self._admitted_or_chunking():
            held[admitted.request.tenant] += len(admitted.rows)
        usage = {job.request.tenant: 0.0 for job in self._jobs.values()}
        usage = {tenant: self.usage.usage(tenant) for tenant in usage}
        while waiting := adapter_admissible(admissible(self._pending, self._fail),  # a grammar still compiling waits
                                            [job for job in self._jobs.values() if job.state != "pending"], self.facts):
            job = waiting[next_admission([job.request.tenant for job in waiting], held, usage)]
            if self.free_rows_for_admission < len(job.rows) or not self._fits(job):
                victim = choose_victim(job, list(self._jobs.values()), self.limits, usage, self._peak_blocks)
                if victim is None:
                    return
                preempt(victim, self._batch, self.stats)
                insort(self._pending, victim, key=lambda pending: pending.handle)  # back in its arrival place
                held[victim.request.tenant] -= len(victim.rows)
                continue
            self._pending.remove(job)
            held[job.request.tenant] += len(job.rows)
            job.state = "admitted"
            if job.admitted_at is None:  # a resumed job keeps its first admission's marks
                job.admitted_at = time.perf_counter()
                job.admitted_wall = time.time()
                if job.time_limit is not None:
                    job.deadline = time.monotonic() + job.time_limit
                self.usage.charge(job.request.tenant, job.prompt_len)
                usage[job.request.tenant] += job.prompt_len  # the rest of this pass sees it too
            self._admitted.append(job)
    def _peak_blocks(self, job: Job) -> int:
        return request_peak_blocks(job.prompt_len, job.request.sampling.max_tokens, len(job.rows), self.pool.block_size)

    @property
    def free_rows_for_admission(self) -> int:
        return self.limits.max_rows - len(self._batch) - sum(len(j.rows) for j in self._admitted_or_chunking())

    def _admitted_or_chunking(self) -> list[Job]:
        chunking = self._prefill.chunking_job
        return self._admitted + ([chunking] if chunking is not None else [])

    def _fits(self, job: Job) -> bool:
        """The running rows' and the admitted ones' blocks stay within the pool at their worst
        point if ``job`` joins."""
        size = self.pool.block_size
        rows = self._batch.futures()
        for j in [*self._admitted_or_chunking(), job]:
            rows += resume_rows(j, size) if j.resuming else request_rows(
                j.prompt_len, j.request.sampling.max_tokens, len(j.rows), j.handle, size)
        return fits_kv_pool(rows, self.pool.capacity, size)

    def _prefill_and_join(self, events: list[RowTokens]) -> None:
        resumed = [job for job in self._admitted if job.resuming]
        if resumed:
            self._admitted = [job for job in self._admitted if not job.resuming]
            for job in resumed:
                resume(job, self._batch, self.runner, self.prefixes, self.stats, fail=self._fail)
        try:
            # A preempted job waits for what took its rows: those prompts do not wait for company.
            joined, self._admitted = self._prefill.run(self._admitted, running_rows=len(self._batch),
                                                       hold=not any(job.resuming for job in self._pending))
            self._join(joined, events)
        finally:  # the rows that joined hold the blocks they need; the step lets go of its own
            self._prefill.release_step()

    def _join(self, joined: list[tuple[Job, PrefilledPrompt]], events: list[RowTokens]) -> None:
        """Each prefilled prompt's rows take their first token from its last logits and join the batch."""
        if not joined:
            return
        rows, row_jobs, prompts = [], [], []
        for job, prompt in joined:
            for row in job.rows:
                if not row.done:
                    rows.append(row)
                    row_jobs.append(job)
                    prompts.append(prompt)
        if not rows:
            return
        logits = torch.stack([p.logits for p in prompts])
        tokens = self._sample(rows, row_jobs, logits, events, batch_rows=len(self._batch) + len(rows))
        for job, _ in joined:
            if job.state != "done":
                job.state = "running"
        keep = [i for i, row in enumerate(rows) if not row.done]
        if keep:
            self._batch.join([rows[i] for i in keep], [row_jobs[i] for i in keep], [prompts[i] for i in keep],
                             tokens[keep])

    # --- ending ------------------------------------------------------------------------------

    def _fail(self, job: Job, error: BaseException) -> None:
        if job.error is None:
            job.error = error
        for row in job.rows:
            row.abort()

    def _collect(self) -> list[Finished]:
        finished = []
        for handle, job in list(self._jobs.items()):
            if not all(row.done for row in job.rows):
                continue
            del self._jobs[handle]
            self.prefixes.drop(job)
            if job in self._pending:
                self._pending.remove(job)
            if job in self._admitted:
                self._admitted.remove(job)
            if self._prefill.chunking_job is job:
                self._prefill.stop_chunking()
            job.state = "done"
            if job.error is not None:
                finished.append(Finished(handle, job.tag, error=job.error))
                continue
            try:
                result = build_result(self.facts, job, self.runner.prompt_logprobs)
            except Exception as error:
                finished.append(Finished(handle, job.tag, error=error))
                continue
            finished.append(Finished(handle, job.tag, result=result, timed_out=job.timed_out,
                                     batch_rows=job.peak_rows))
        return finished
