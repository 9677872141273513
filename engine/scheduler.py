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
3. pending requests are admitted, the tenant holding the fewest rows first (first come first served
   within a tenant, and for a tenant alone: :func:`engine.capacity.next_admission`), while the rows
   (``max_rows``) and the KV pool (``kv_cache_tokens`` in blocks of ``kv_block_tokens``: the
   blocks of every admitted row at the worst point of their futures) allow. When they do not, and
   the tenant is below an even share of the batch while another is above it, that tenant's newest
   running request is preempted (:func:`engine.capacity.fair_share_victim`): its rows stop, its
   blocks go back (named, so its prompt is found again), and it ends ``preempted`` for its caller to
   run again;
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
as one object), admission in blocks (:func:`engine.capacity.fits_kv_pool`), prefill planning
(:mod:`engine.prefill_plan`: prompt groups, cached blocks a prefill starts after, chunking), block
names (:mod:`engine.prefix_hash`), sampling (:mod:`engine.batch_sampler`) and result building
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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.batch_inputs import check_placeholders, check_prompt, request_features
from engine.batch_sampler import RowTokens, sample_step
from engine.capacity import (
    SchedulerLimits,
    check_capacity,
    dominant_share,
    fair_share_victim,
    fits_kv_pool,
    next_admission,
    request_peak_blocks,
    request_rows,
)
from engine.decoding import RowDecoder
from engine.encoder_cache import MediaUnit, tensors_hash, unit_key
from engine.errors import InvalidRequestError
from engine.model_facts import ModelFacts
from engine.paged_kv import PagedPrompt
from engine.prefill_plan import PrefillPlan, hold_joins, plan_prefill, reusable_blocks
from engine.prefix_hash import MediaSpan, PromptHashes, chain, prompt_hashes
from engine.prompt_cache import PrefilledPrompt, PromptEnds
from engine.request_result import build_result
from engine.running_batch import RunningBatch
from engine.sampling import choice_seed
from engine.sampling_params import SamplingParams
from engine.step_runner import PromptInput, StepRunner


@dataclass
class EngineStats:
    """Counters since the engine started (the GPU worker reports their growth as metrics)."""

    prefill_tokens: int = 0  # prompt tokens computed (real tokens, not padding)
    prefill_forwards: int = 0  # forwards that computed prompts (a chunk of a long prompt counts one)
    cached_tokens: int = 0  # prompt tokens served by cached KV blocks or a shared prefill
    decode_steps: int = 0
    preempted_requests: int = 0  # running requests stopped to give another tenant its share
    decode_rows: int = 0  # sum over decode steps of the rows in them
    kv_live_tokens: int = 0  # sum over decode steps of the tokens the rows attend to
    kv_held_tokens: int = 0  # sum over decode steps of the KV pool's blocks in use, in tokens
    kv_read_tokens: int = 0  # sum over decode steps of rows x the longest row (what a left-padded cache holds)

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class Finished:
    """A request that ended: its result, or the error that ended it alone."""

    handle: int
    tag: Any
    result: Any = None  # engine.generation.GenerationResult
    error: BaseException | None = None
    timed_out: bool = False  # its deadline stopped it (its rows end with "abort")
    preempted: bool = False  # stopped to give another tenant its share: run it again (no result)
    batch_rows: int = 0  # the most rows that decoded in one step with this request's rows


@dataclass(frozen=True)
class ChoiceSoFar:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None  # None: the request asked for none
    finish_reason: str | None


@dataclass
class _Job:
    handle: int
    tag: Any
    request: Any  # GenerationRequest
    features: dict[str, torch.Tensor]
    units: list[MediaUnit]
    key: tuple
    names: PromptHashes | None  # its prompt's block names (None: prefix caching is off)
    rows: list[RowDecoder]
    time_limit: float | None  # seconds from admission: its deadline is set then
    state: str = "pending"  # pending -> admitted -> running -> done
    admitted_at: float | None = None
    admitted_wall: float | None = None
    first_token_at: float | None = None
    cached_tokens: int = 0
    error: BaseException | None = None
    timed_out: bool = False
    preempted: bool = False
    deadline: float | None = None
    abort_requested: bool = False
    peak_rows: int = 0
    prefix: list[int] = field(default_factory=list)  # cached blocks its prefill starts from (held)
    prefix_tokens: int = 0  # the tokens they hold

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def compute_len(self) -> int:
        """The prompt tokens its prefill computes: those after its cached blocks."""
        return self.prompt_len - self.prefix_tokens


@dataclass
class _Chunking:
    """A long prompt being prefilled one chunk per step."""

    job: _Job
    prefill: Any  # the runner's state (StepRunner.start_chunked)
    reused: int  # its tokens found in cached blocks


StepHook = Callable[[list[RowTokens]], None]


class Scheduler:
    """The continuous batch of one model, planned from its ``facts`` and run by ``runner`` (whose
    pool holds the KV blocks). Not thread-safe: one thread submits and steps (:meth:`abort` may be
    called from elsewhere: it only sets a flag)."""

    def __init__(self, facts: ModelFacts, runner: StepRunner, limits: SchedulerLimits | None = None, *,
                 prompt_ends: PromptEnds | None = None, stats: EngineStats | None = None,
                 on_step: StepHook | None = None):
        self.facts, self.runner, self.pool = facts, runner, runner.pool
        self.limits = limits = limits or SchedulerLimits()
        self.prompt_ends = prompt_ends if prompt_ends is not None else PromptEnds(limits.prompt_cache_tokens)
        self.stats = stats if stats is not None else EngineStats()
        self.on_step = on_step
        media = sorted(t for t in facts.media_token_ids.values() if 0 <= t < facts.vocab_size)
        self._placeholder_ids = torch.tensor(media, dtype=torch.long) if media else None
        self._next_handle = 0
        self._jobs: dict[int, _Job] = {}
        self._pending: list[_Job] = []
        self._admitted: list[_Job] = []  # admitted, waiting for their prompt's prefill
        self._chunking: _Chunking | None = None
        self._batch = RunningBatch(self.pool, attn_implementation=self.runner.attn_implementation,
                                   dtype=facts.dtype, device=facts.device, on_row_done=self._keep_decoded_blocks)
        self._step_prompts: list[PrefilledPrompt] = []  # prefilled this step: released once their rows joined
        self._join_waited = 0  # steps in a row that admitted prompts waited for company (hold_joins)

    # --- submitting ---------------------------------------------------------------------------

    def check(self, request) -> dict[str, torch.Tensor]:
        """Refuse what can never run (typed errors); the request's model features otherwise."""
        facts, params = self.facts, request.sampling
        check_prompt(facts, request.prompt_token_ids, params.max_tokens)
        features = request_features(request.items, request.mm_kwargs)
        check_placeholders(facts, request.prompt_token_ids, features)
        if params.stop and facts.tokenizer is None:
            raise InvalidRequestError("stop strings need the model's tokenizer, which this model directory lacks",
                                      errors={"stop": ["not supported by this model"]})
        check_capacity(self.limits, len(request.prompt_token_ids), params.max_tokens, params.n)
        return features

    def submit(self, request, *, tag: Any = None, time_limit: float | None = None,
               features: dict[str, torch.Tensor] | None = None) -> int:
        """Queue ``request`` (an ``engine.generation.GenerationRequest``); returns its handle.
        ``time_limit``: seconds from its admission (not its wait); its rows stop then and it ends
        ``timed_out``."""
        if features is None:
            features = self.check(request)
        facts = self.facts
        handle = self._next_handle
        self._next_handle += 1
        units = _media_units(facts, request, features)
        key = (request.cache_scope, facts.weight_version, tuple(request.prompt_token_ids),
               tuple(unit.key for unit in units))
        names = None
        if self.limits.prefix_caching:
            names = prompt_hashes(request.cache_scope, facts.weight_version, request.prompt_token_ids,
                                  self.pool.block_size, [MediaSpan(*unit.span, unit.key) for unit in units])
        eos = frozenset(facts.eos_token_ids)
        rows = [RowDecoder(handle, c, request.sampling, _generator(facts, request.sampling, c),
                           prompt_token_ids=request.prompt_token_ids, eos_token_ids=eos, tokenizer=facts.tokenizer)
                for c in range(request.sampling.n)]
        job = _Job(handle, tag, request, features, units, key, names, rows, time_limit)
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
        for prompt in self._step_prompts:
            prompt.kv.release()
        self._step_prompts = []
        for job in self._jobs.values():
            for row in job.rows:
                row.abort()
            self._drop_prefix(job)
        self._batch.drop_finished()
        self._jobs.clear()
        self._stop_chunking()
        self._pending, self._admitted = [], []

    # --- one step -----------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """One scheduling iteration (see the module docstring); the requests that ended in it."""
        events: list[RowTokens] = []
        self._stop_aborted_and_expired()
        if self._batch:
            self._decode(events)
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
        tokens = self._sample(batch.rows, batch.jobs, logits, events, batch_rows=len(batch))
        batch.advance(tokens)

    def _sample(self, rows: Sequence[RowDecoder], jobs: Sequence[_Job], logits: torch.Tensor,
                events: list[RowTokens], *, batch_rows: int) -> torch.Tensor:
        return sample_step(rows, jobs, logits, placeholder_ids=self._placeholder_ids, events=events,
                           batch_rows=batch_rows, fail=self._fail)

    def _admit(self) -> None:
        if not self._pending:
            return
        held = Counter(job.request.tenant for job in self._batch.jobs)  # a row each
        for admitted in self._admitted_or_chunking():
            held[admitted.request.tenant] += len(admitted.rows)
        while self._pending:
            index = next_admission([job.request.tenant for job in self._pending], held)
            job = self._pending[index]
            if self.free_rows_for_admission < len(job.rows) or not self._fits(job):
                victim = self._preempt_for(job)
                if victim is None:
                    return
                held[victim.request.tenant] -= len(victim.rows)
                continue
            self._pending.pop(index)
            held[job.request.tenant] += len(job.rows)
            job.state = "admitted"
            job.admitted_at = time.perf_counter()
            job.admitted_wall = time.time()
            if job.time_limit is not None:
                job.deadline = time.monotonic() + job.time_limit
            self._admitted.append(job)

    def _preempt_for(self, waiting: _Job) -> _Job | None:
        """Preempt the running request that gives way to ``waiting``'s tenant, if one does
        (:func:`engine.capacity.fair_share_victim`); its blocks are free when this returns."""
        live = [job for job in self._jobs.values() if job.state != "done" and not job.preempted]
        tenants = len({job.request.tenant for job in live})
        if tenants < 2:  # a key alone keeps the whole batch (and the common case costs one pass)
            return None
        holding = [job for job in live if job.state != "pending"]  # admitted or running
        peak = {job.handle: self._peak_blocks(job) for job in [*holding, waiting]}
        rows, blocks = Counter(), Counter()
        for job in holding:
            rows[job.request.tenant] += len(job.rows)
            blocks[job.request.tenant] += peak[job.handle]
        shares = {tenant: dominant_share(rows[tenant], blocks[tenant], self.limits) for tenant in rows}
        running = sorted((job for job in holding if job.state == "running"), key=lambda job: job.admitted_at)
        victim = fair_share_victim(
            waiting.request.tenant, dominant_share(len(waiting.rows), peak[waiting.handle], self.limits), shares,
            [(job.request.tenant, dominant_share(len(job.rows), peak[job.handle], self.limits)) for job in running],
            tenants=tenants)
        if victim is None:
            return None
        job = running[victim]
        job.preempted = True
        for row in job.rows:
            row.abort()
        self._batch.drop_finished()
        self.stats.preempted_requests += 1
        return job

    def _peak_blocks(self, job: _Job) -> int:
        return request_peak_blocks(job.prompt_len, job.request.sampling.max_tokens, len(job.rows), self.pool.block_size)

    @property
    def free_rows_for_admission(self) -> int:
        return self.limits.max_rows - len(self._batch) - sum(len(j.rows) for j in self._admitted_or_chunking())

    def _admitted_or_chunking(self) -> list[_Job]:
        return self._admitted + ([self._chunking.job] if self._chunking is not None else [])

    def _fits(self, job: _Job) -> bool:
        """The running rows' and the admitted ones' blocks stay within the pool at their worst
        point if ``job`` joins."""
        size = self.pool.block_size
        rows = self._batch.futures()
        for j in [*self._admitted_or_chunking(), job]:
            rows += request_rows(j.prompt_len, j.request.sampling.max_tokens, len(j.rows), j.handle, size)
        return fits_kv_pool(rows, self.pool.capacity, size)

    def _prefill_and_join(self, events: list[RowTokens]) -> None:
        try:
            self._prefill_and_join_rows(events)
        finally:  # the rows that joined hold the blocks they need; the step lets go of its own
            for prompt in self._step_prompts:
                prompt.kv.release()
            self._step_prompts = []

    def _prefill_and_join_rows(self, events: list[RowTokens]) -> None:
        joined: list[tuple[_Job, PrefilledPrompt]] = []
        if self._chunking is not None:
            joined += self._prefill_chunk()
        else:
            joined += self._prefill_admitted()
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

    def _prefill_admitted(self) -> list[tuple[_Job, PrefilledPrompt]]:
        """Admitted jobs whose prompts are ready after this step's prefill (cached ones first)."""
        plan = plan_prefill(self._admitted, self._find_cached,
                            budget=self.limits.prefill_chunk_tokens if self._batch else None)
        plan = self._hold_lone_joins(plan)
        taken = set(map(id, plan.taken))
        self._admitted = [job for job in self._admitted if id(job) not in taken]
        for job, _ in plan.cached:
            self._count_cached(job, job.prompt_len)
        joined = list(plan.cached)
        if plan.chunked is not None:
            self._start_chunking(plan.chunked)
        if plan.groups:
            joined += self._compute_prompts(plan.groups)
        if self._chunking is not None and not joined:
            joined += self._prefill_chunk()
        return joined

    def _hold_lone_joins(self, plan: PrefillPlan) -> PrefillPlan:
        """``plan`` without its prompts to compute while they wait for company (``hold_joins``);
        what needs no forward (cached prompts, ended jobs) goes on. Company counts every admitted
        row to compute, also past this step's prefill budget (waiting would not widen the forward)."""
        if not plan.groups:
            return plan
        cached = {id(job) for job, _ in plan.cached}
        joining = sum(len(job.rows) for job in self._admitted if job.state != "done" and id(job) not in cached)
        limits = self.limits
        if not hold_joins(running=len(self._batch), joining=joining, waited_steps=self._join_waited,
                          ratio=limits.join_ratio, max_wait_steps=limits.join_wait_steps):
            self._join_waited = 0
            return plan
        self._join_waited += 1
        waiting = {id(job) for jobs in plan.groups.values() for job in jobs}
        return replace(plan, groups={}, taken=[job for job in plan.taken if id(job) not in waiting])

    def _find_cached(self, job: _Job) -> PrefilledPrompt | None:
        """``job``'s prompt found whole in the pool (every block, and its last logits: it joins with
        no forward), or None, having taken the cached blocks its prefill starts from (``prefix``)."""
        self._drop_prefix(job)  # what it held while it waited may have grown
        names, pool = job.names, self.pool
        if names is None:
            return None
        every = [*names.full, names.tail] if names.tail is not None else list(names.full)
        end = self.prompt_ends.get(names.last)
        if end is not None and len(blocks := pool.cached_run(every)) == len(every):
            pool.share(blocks)
            prompt = PrefilledPrompt(PagedPrompt(pool, blocks, job.prompt_len), end.logits, end.rope_delta,
                                     job.prompt_len)
            self._step_prompts.append(prompt)
            return prompt
        found = pool.cached_run(names.full)
        count = reusable_blocks(len(found), pool.block_size, job.prompt_len, [unit.span for unit in job.units])
        job.prefix, job.prefix_tokens = found[:count], count * pool.block_size
        pool.share(job.prefix)
        return None

    def _drop_prefix(self, job: _Job) -> None:
        self.pool.release(job.prefix)
        job.prefix, job.prefix_tokens = [], 0

    def _keep(self, job: _Job, prompt: PrefilledPrompt) -> None:
        """Name a computed prompt's blocks and keep its last logits, so later requests find it
        (never a prompt whose forward went non-finite)."""
        names = job.names
        if names is None or not prompt.finite:
            return
        pool = self.pool
        for block, name in zip(prompt.kv.blocks, [*names.full, names.tail], strict=False):
            if name is not None:
                pool.name(block, name)
        self.prompt_ends.put(names.last, prompt)

    def _keep_decoded_blocks(self, row: RowDecoder, job: _Job, table: list[int], length: int) -> None:
        """A finished row's full blocks past its prompt's, named by its prompt and the tokens it
        decoded: the next turn of an agent, which repeats them, computes none of them again."""
        names, size = job.names, self.pool.block_size
        if names is None or job.error is not None or length // size <= len(names.full):
            return
        tokens = [*job.request.prompt_token_ids, *row.token_ids][:length]
        parent = names.full[-1] if names.full else names.root
        first = len(names.full)
        for block, name in zip(table[first:], chain(parent, tokens, size, [MediaSpan(*u.span, u.key) for u in job.units],
                                                    first_block=first), strict=False):
            self.pool.name(block, name)

    def _compute_prompts(self, groups: dict[tuple, list[_Job]]) -> list[tuple[_Job, PrefilledPrompt]]:
        leaders = [jobs[0] for jobs in groups.values()]
        starts = [job.prefix_tokens for job in leaders]
        try:
            prefilled = zip(self.runner.prefill([self._prompt_input(job) for job in leaders]), starts, strict=True)
        except Exception as error:
            if len(leaders) == 1:
                for job in groups[leaders[0].key]:
                    self._fail(job, error)
                return []
            # One bad prompt must not fail the others: prefill each alone to find it.
            out = []
            for key, jobs in groups.items():
                out += self._compute_prompts({key: jobs})
            return out
        out = []
        for leader, (prompt, reused) in zip(leaders, prefilled, strict=True):
            self._step_prompts.append(prompt)
            self._keep(leader, prompt)
            self.stats.prefill_tokens += prompt.length - reused
            for i, job in enumerate(groups[leader.key]):
                self._count_cached(job, job.prompt_len if i else reused)
                out.append((job, prompt))
        return out

    def _count_cached(self, job: _Job, tokens: int) -> None:
        job.cached_tokens = tokens
        self.stats.cached_tokens += tokens

    def _prompt_input(self, job: _Job) -> PromptInput:
        """What the runner prefills for ``job``; its cached prefix (and the references) go with it."""
        prompt = PromptInput(job.request.prompt_token_ids, job.features, job.units, job.prefix, job.prefix_tokens)
        job.prefix, job.prefix_tokens = [], 0
        return prompt

    def _start_chunking(self, job: _Job) -> None:
        start = job.prefix_tokens
        self._chunking = _Chunking(job, self.runner.start_chunked(self._prompt_input(job)), reused=start)

    def _prefill_chunk(self) -> list[tuple[_Job, PrefilledPrompt]]:
        """The next chunk of the long prompt being prefilled; the prompt once its last chunk ran."""
        state = self._chunking
        job = state.job
        if job.state == "done":
            self._stop_chunking()
            return []
        try:
            prompt = self.runner.prefill_chunk(state.prefill, self.limits.prefill_chunk_tokens)
        except Exception as error:
            self._chunking = None
            self._fail(job, error)
            return []
        if prompt is None:
            return []
        self._chunking = None
        self._step_prompts.append(prompt)
        self._keep(job, prompt)
        self.stats.prefill_tokens += prompt.length - state.reused
        self._count_cached(job, state.reused)
        return [(job, prompt)]

    def _stop_chunking(self) -> None:
        if self._chunking is not None:
            self.runner.drop_chunked(self._chunking.prefill)
            self._chunking = None

    # --- ending ------------------------------------------------------------------------------

    def _fail(self, job: _Job, error: BaseException) -> None:
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
            self._drop_prefix(job)
            if job in self._pending:
                self._pending.remove(job)
            if job in self._admitted:
                self._admitted.remove(job)
            if self._chunking is not None and self._chunking.job is job:
                self._stop_chunking()
            job.state = "done"
            if job.preempted:
                finished.append(Finished(handle, job.tag, preempted=True))
                continue
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

def _media_units(facts: ModelFacts, request, features) -> list[MediaUnit]:
    """The request's media as encoder units: one per finalized item (by content hash), or all of
    its ready-made tensors as one unit."""
    if not features:
        return []
    if request.items and all(item.content_hash for item in request.items):
        return [MediaUnit(unit_key(facts.weight_version, f"{item.modality}:{item.content_hash}"), item.tensors(),
                          tuple(item.offset))
                for item in sorted(request.items, key=lambda i: i.offset)]
    media = set(facts.media_token_ids.values())
    at = [i for i, t in enumerate(request.prompt_token_ids) if t in media]
    return [MediaUnit(unit_key(facts.weight_version, tensors_hash(features)), features, (at[0], at[-1] + 1))]


def _generator(facts: ModelFacts, params: SamplingParams, choice: int) -> torch.Generator | None:
    """A seeded row's own generator; None for greedy rows and for unseeded ones (they share one
    draw per step: engine/sampling.py)."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device=facts.device)
    generator.manual_seed(choice_seed(params.seed, choice))
    return generator
