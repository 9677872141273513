"""Iteration-level (continuous) scheduling: requests join the running batch between decode steps
and leave the moment they finish.

Why by hand: transformers' own continuous batching (``generate_batch``, ``init_continuous_batching``)
takes token ids only and drops ``pixel_values`` (transformers#43386; docs/architecture.md), so it cannot serve
a multimodal request. What this module uses of transformers: the model's forward (its own mask
building from a 2-D ``attention_mask`` and its ``DynamicCache`` for prefills; its attention over
the paged cache's ``update`` seam for decode steps), its position handling (``_prepare_position_ids_for_generation``, which
gives Qwen-VL's M-RoPE positions and per-row ``rope_deltas``) and its ``mm_encoder_outputs`` seam
(media encoded before the forward). Written here: admission, the paged KV cache of the running rows
(:mod:`engine.paged_kv`), per-row positions during decoding, chunked prefill, prompt sharing.

One :meth:`Scheduler.step`:

1. aborts and expired deadlines end their rows (a pending request ends without running);
2. one decode forward over the running rows; each row picks its token with its own
   :class:`~engine.decoding.RowDecoder` (parameters, seeded generator, penalties, stops) and
   rows that finished leave the batch, their KV blocks back in the pool at once;
3. pending requests are admitted, first come first served, while the rows
   (``max_rows``) and the KV pool (``kv_cache_tokens`` in blocks of ``kv_block_tokens``: the
   blocks of every admitted row at the worst point of their futures) allow;
4. admitted prompts are prefilled: each distinct prompt (token ids + media keys) once, whatever
   the number of rows that share it (``n > 1``, or separate requests); a prompt still in the
   small prompt LRU is not computed at all. Short prompts go together in one padded forward, at
   most ``prefill_chunk_tokens`` tokens while rows are decoding; a longer one is prefilled alone
   in chunks of that size, one chunk per step, so decoding rows keep their pace. A prefilled
   prompt's K/V is written into pool blocks; each row of the prompt takes its first token from
   the prompt's last logits and joins the running batch sharing those blocks. While rows decode,
   prompts to compute wait until they are ``join_ratio`` of the running rows, at most
   ``join_wait_steps`` steps (:func:`engine.prefill_plan.hold_joins`): one forward for several.

The parts, each testable without a model: the KV pool (:mod:`engine.paged_kv`), the running
batch (:mod:`engine.running_batch`: rows, their jobs, block tables, lengths, deltas and next tokens
as one object), admission in blocks (:func:`engine.capacity.fits_kv_pool`), prefill planning (:mod:`engine.prefill_plan`:
prompt groups, the prompt cache, chunking), sampling (:mod:`engine.batch_sampler`) and result
building (:mod:`engine.request_result`). This module runs the forwards and moves jobs through
their states (pending -> admitted -> running -> done).

Positions: a row's next text position is the number of real tokens it has; M-RoPE models add the
row's rope delta (from transformers' own ``get_rope_index``), so rows of any length and media share
a batch and each sees the positions it would see alone.

Errors: a request that fails (its prefill, or its row's sampling) ends alone with its error; the
rest of the batch goes on. A failing decode forward ends every running request with the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.batch_inputs import (
    Row,
    check_placeholders,
    check_prompt,
    collate,
    prompt_positions,
    request_features,
)
from engine.batch_sampler import RowTokens, sample_step
from engine.capacity import SchedulerLimits, check_capacity, fits_kv_pool, request_rows
from engine.decoding import RowDecoder
from engine.encoder_cache import (
    EncoderCache,
    MediaUnit,
    encode,
    encoder_input_names,
    supports_encoder_outputs,
    tensors_hash,
    unit_key,
)
from engine.errors import InvalidRequestError
from engine.loading import LoadedModel
from engine.paged_kv import BlockPool, PagedPrompt, prefix_cache, write_prompts
from engine.prefill_plan import PrefillPlan, chunk_end, hold_joins, plan_prefill, reusable_blocks
from engine.prefix_hash import MediaSpan, PromptHashes, chain, prompt_hashes
from engine.prompt_cache import PrefilledPrompt, PromptEnds
from engine.request_result import build_result
from engine.running_batch import RunningBatch
from engine.sampling import choice_seed
from engine.sampling_params import SamplingParams


@dataclass
class EngineStats:
    """Counters since the engine started (the GPU worker reports their growth as metrics)."""

    prefill_tokens: int = 0  # prompt tokens computed (real tokens, not padding)
    prefill_forwards: int = 0  # forwards that computed prompts (a chunk of a long prompt counts one)
    cached_tokens: int = 0  # prompt tokens served by cached KV blocks or a shared prefill
    decode_steps: int = 0
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
    deadline: float | None
    state: str = "pending"  # pending -> admitted -> running -> done
    admitted_at: float | None = None
    admitted_wall: float | None = None
    first_token_at: float | None = None
    cached_tokens: int = 0
    error: BaseException | None = None
    timed_out: bool = False
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

    key: tuple
    job: _Job
    batch: dict[str, torch.Tensor]
    positions: torch.Tensor
    rope_delta: int | None
    cache: Any = None
    done: int = 0  # tokens prefilled so far
    reused: int = 0  # of them, those found in cached blocks


StepHook = Callable[[list[RowTokens]], None]


class Scheduler:
    """The continuous batch of one model. Not thread-safe: one thread submits and steps
    (:meth:`abort` may be called from elsewhere: it only sets a flag)."""

    def __init__(self, loaded: LoadedModel, limits: SchedulerLimits | None = None, *,
                 encoder_cache: EncoderCache | None = None, prompt_ends: PromptEnds | None = None,
                 pool: BlockPool | None = None, stats: EngineStats | None = None, on_step: StepHook | None = None):
        self.loaded = loaded
        self.limits = limits = limits or SchedulerLimits()
        self.encoder_cache = encoder_cache
        self.prompt_ends = prompt_ends if prompt_ends is not None else PromptEnds(limits.prompt_cache_tokens)
        # A scheduler of its own has its own pool; an engine's schedulers share the engine's.
        self.pool = pool if pool is not None else BlockPool(limits.kv_blocks, limits.kv_block_tokens)
        self.stats = stats if stats is not None else EngineStats()
        self.on_step = on_step
        self._uses_encoder_outputs = supports_encoder_outputs(loaded.model)
        self._encoder_inputs = encoder_input_names(loaded.model) if self._uses_encoder_outputs else set()
        media = sorted(t for t in loaded.media_token_ids.values() if 0 <= t < loaded.vocab_size)
        self._placeholder_ids = torch.tensor(media, dtype=torch.long) if media else None
        self._next_handle = 0
        self._jobs: dict[int, _Job] = {}
        self._pending: list[_Job] = []
        self._admitted: list[_Job] = []  # admitted, waiting for their prompt's prefill
        self._chunking: _Chunking | None = None
        self._batch = RunningBatch(self.pool, attn_implementation=_attn_implementation(loaded.model),
                                   dtype=loaded.dtype, device=loaded.device, on_row_done=self._keep_decoded_blocks)
        self._step_prompts: list[PrefilledPrompt] = []  # prefilled this step: released once their rows joined
        self._join_waited = 0  # steps in a row that admitted prompts waited for company (hold_joins)

    # --- submitting ---------------------------------------------------------------------------

    def check(self, request) -> dict[str, torch.Tensor]:
        """Refuse what can never run (typed errors); the request's model features otherwise."""
        loaded, params = self.loaded, request.sampling
        check_prompt(loaded, request.prompt_token_ids, params.max_tokens)
        features = request_features(request.items, request.mm_kwargs)
        check_placeholders(loaded, request.prompt_token_ids, features)
        if params.stop and loaded.tokenizer is None:
            raise InvalidRequestError("stop strings need the model's tokenizer, which this model directory lacks",
                                      errors={"stop": ["not supported by this model"]})
        check_capacity(self.limits, len(request.prompt_token_ids), params.max_tokens, params.n)
        return features

    def submit(self, request, *, tag: Any = None, deadline: float | None = None,
               features: dict[str, torch.Tensor] | None = None) -> int:
        """Queue ``request`` (an ``engine.generation.GenerationRequest``); returns its handle.
        ``deadline`` (``time.monotonic()``): its rows stop then and it ends ``timed_out``."""
        if features is None:
            features = self.check(request)
        loaded = self.loaded
        handle = self._next_handle
        self._next_handle += 1
        units = _media_units(loaded, request, features)
        key = (request.cache_scope, loaded.weight_version, tuple(request.prompt_token_ids),
               tuple(unit.key for unit in units))
        names = None
        if self.limits.prefix_caching:
            names = prompt_hashes(request.cache_scope, loaded.weight_version, request.prompt_token_ids,
                                  self.pool.block_size, [MediaSpan(*unit.span, unit.key) for unit in units])
        eos = frozenset(loaded.eos_token_ids)
        rows = [RowDecoder(handle, c, request.sampling, _generator(loaded, request.sampling, c),
                           prompt_token_ids=request.prompt_token_ids, eos_token_ids=eos, tokenizer=loaded.tokenizer)
                for c in range(request.sampling.n)]
        job = _Job(handle, tag, request, features, units, key, names, rows, deadline)
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
        """Rows a new request could take now (the GPU worker reserves no more messages than this)."""
        return max(0, self.free_rows_for_admission - sum(len(j.rows) for j in self._pending))

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
        self._pending, self._admitted, self._chunking = [], [], None

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
        loaded, batch = self.loaded, self._batch
        try:
            inputs = batch.decode_inputs()
            with loaded.lock, torch.inference_mode():
                out = loaded.model(**inputs, use_cache=True, logits_to_keep=1)
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
        tokens = self._sample(batch.rows, batch.jobs, out.logits[:, -1].float(), events, batch_rows=len(batch))
        batch.advance(tokens)

    def _sample(self, rows: Sequence[RowDecoder], jobs: Sequence[_Job], logits: torch.Tensor,
                events: list[RowTokens], *, batch_rows: int) -> torch.Tensor:
        return sample_step(rows, jobs, logits, placeholder_ids=self._placeholder_ids, events=events,
                           batch_rows=batch_rows, fail=self._fail)

    def _admit(self) -> None:
        while self._pending:
            job = self._pending[0]
            if self.free_rows_for_admission < len(job.rows) or not self._fits(job):
                return
            self._pending.pop(0)
            job.state = "admitted"
            job.admitted_at = time.perf_counter()
            job.admitted_wall = time.time()
            self._admitted.append(job)

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
        try:
            prefilled = self._prefill(leaders)
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
            self._keep(leader, prompt)
            self.stats.prefill_tokens += prompt.length - reused
            for i, job in enumerate(groups[leader.key]):
                self._count_cached(job, job.prompt_len if i else reused)
                out.append((job, prompt))
        return out

    def _count_cached(self, job: _Job, tokens: int) -> None:
        job.cached_tokens = tokens
        self.stats.cached_tokens += tokens

    def _prefill(self, jobs: Sequence[_Job]) -> list[tuple[PrefilledPrompt, int]]:
        """One padded forward over the prompts of ``jobs``, each from the end of its cached blocks
        (``prefix``, attended to from the pool): each prompt's KV, last logits and delta, and the
        tokens it took from the cache. Positions and deltas are the whole prompts' (M-RoPE ones
        continue from the cached part)."""
        loaded = self.loaded
        batch = collate(loaded, [Row(job.request.prompt_token_ids, job.features) for job in jobs])
        positions, deltas = prompt_positions(loaded, batch)
        starts = [job.prefix_tokens for job in jobs]
        units = [unit for job, start in zip(jobs, starts, strict=True) for unit in job.units if unit.span[0] >= start]
        past = {}
        if any(starts):
            # The rest of each prompt, right-aligned after its cached blocks (left-padded to the
            # longest): [padding | cached prefix][padding | rest]; the mask hides both paddings.
            rest = collate(loaded, [Row(job.request.prompt_token_ids[start:],
                                        job.features if any(u.span[0] >= start for u in job.units) else {})
                                    for job, start in zip(jobs, starts, strict=True)])
            width = max(starts)
            cached_mask = torch.tensor([[0] * (width - start) + [1] * start for start in starts],
                                       dtype=rest["attention_mask"].dtype, device=loaded.device)
            rest["attention_mask"] = torch.cat([cached_mask, rest["attention_mask"]], dim=1)
            positions = positions[..., -rest["input_ids"].shape[1]:]
            past["cache"] = prefix_cache(self.pool, [job.prefix for job in jobs], dtype=loaded.dtype)
            batch = rest
        kwargs = self._forward_inputs(batch, units)
        with loaded.lock, torch.inference_mode():
            out = loaded.model(**kwargs, **past, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.stats.prefill_forwards += 1
        prefixes = [job.prefix for job in jobs]
        for job in jobs:  # the prompts written take over these references (or give them back)
            job.prefix, job.prefix_tokens = [], 0
        kvs = write_prompts(self.pool, _cache_of(out), [job.prompt_len for job in jobs], prefixes)
        logits = out.logits[:, -1].float()
        prompts = [PrefilledPrompt(kv, logits[i].clone(), None if deltas is None else int(deltas[i]), kv.length)
                   for i, kv in enumerate(kvs)]
        self._step_prompts += prompts
        return list(zip(prompts, starts, strict=True))

    def _start_chunking(self, job: _Job) -> None:
        batch = collate(self.loaded, [Row(job.request.prompt_token_ids, job.features)])
        positions, deltas = prompt_positions(self.loaded, batch)
        state = _Chunking(job.key, job, batch, positions, None if deltas is None else int(deltas[0]))
        if job.prefix:
            state.cache = prefix_cache(self.pool, [job.prefix], dtype=self.loaded.dtype)
            state.done = state.reused = job.prefix_tokens
        self._chunking = state

    def _prefill_chunk(self) -> list[tuple[_Job, PrefilledPrompt]]:
        """The next chunk of the long prompt being prefilled; the prompt once its last chunk ran."""
        state = self._chunking
        job = state.job
        if job.state == "done":
            self._chunking = None
            return []
        length = job.prompt_len
        start = state.done
        units = job.units
        end = chunk_end(start, length, self.limits.prefill_chunk_tokens, [unit.span for unit in units],
                        media_in_one_forward=not self._uses_encoder_outputs)
        chunk_units = [unit for unit in units if start <= unit.span[0] < end]
        batch = {name: value[:, start:end] if name in ("input_ids", "mm_token_type_ids") else value
                 for name, value in state.batch.items()}
        batch["attention_mask"] = state.batch["attention_mask"][:, :end]
        if not chunk_units:
            batch = {name: value for name, value in batch.items()
                     if name in ("input_ids", "attention_mask", "mm_token_type_ids")}
        kwargs = self._forward_inputs(batch, chunk_units)
        loaded = self.loaded
        try:
            with loaded.lock, torch.inference_mode():
                out = loaded.model(**kwargs, position_ids=state.positions[..., start:end], cache=state.cache,
                                   use_cache=True, logits_to_keep=1)
        except Exception as error:
            self._chunking = None
            self._fail(job, error)
            return []
        self.stats.prefill_forwards += 1
        state.cache = _cache_of(out)
        state.done = end
        if end < length:
            return []
        self._chunking = None
        prefix = job.prefix
        job.prefix, job.prefix_tokens = [], 0  # the prompt written takes over these references
        try:
            kv = write_prompts(self.pool, state.cache, [length], [prefix])[0]
        except Exception as error:
            self._fail(job, error)
            return []
        prompt = PrefilledPrompt(kv, out.logits[0, -1].float().clone(), state.rope_delta, length)
        self._step_prompts.append(prompt)
        self._keep(job, prompt)
        self.stats.prefill_tokens += length - state.reused
        self._count_cached(job, state.reused)
        return [(job, prompt)]

    def _forward_inputs(self, batch: dict[str, torch.Tensor], units: Sequence[MediaUnit]) -> dict[str, Any]:
        if not units or not self._uses_encoder_outputs:
            return dict(batch)
        kwargs = {name: value for name, value in batch.items() if name not in self._encoder_inputs}
        with torch.inference_mode():
            kwargs["mm_encoder_outputs"] = encode(self.loaded.model, [_on_device(u, self.loaded) for u in units],
                                                  self.encoder_cache)
        return kwargs

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
                self._chunking = None
            job.state = "done"
            if job.error is not None:
                finished.append(Finished(handle, job.tag, error=job.error))
                continue
            try:
                result = build_result(self.loaded, job)
            except Exception as error:
                finished.append(Finished(handle, job.tag, error=error))
                continue
            finished.append(Finished(handle, job.tag, result=result, timed_out=job.timed_out,
                                     batch_rows=job.peak_rows))
        return finished

def _media_units(loaded: LoadedModel, request, features) -> list[MediaUnit]:
    """The request's media as encoder units: one per finalized item (by content hash), or all of
    its ready-made tensors as one unit."""
    if not features:
        return []
    if request.items and all(item.content_hash for item in request.items):
        return [MediaUnit(unit_key(loaded.weight_version, f"{item.modality}:{item.content_hash}"), item.tensors(),
                          tuple(item.offset))
                for item in sorted(request.items, key=lambda i: i.offset)]
    media = set(loaded.media_token_ids.values())
    at = [i for i, t in enumerate(request.prompt_token_ids) if t in media]
    return [MediaUnit(unit_key(loaded.weight_version, tensors_hash(features)), features, (at[0], at[-1] + 1))]


def _on_device(unit: MediaUnit, loaded: LoadedModel) -> MediaUnit:
    moved = {name: value.to(device=loaded.device, dtype=loaded.dtype) if value.is_floating_point()
             else value.to(loaded.device) for name, value in unit.features.items()}
    return MediaUnit(unit.key, moved, unit.span)


def _attn_implementation(model) -> str | None:
    """The attention the decoder layers run (what the decode mask is built for)."""
    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _generator(loaded: LoadedModel, params: SamplingParams, choice: int) -> torch.Generator | None:
    """A seeded row's own generator; None for greedy rows and for unseeded ones (they share one
    draw per step: engine/sampling.py)."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device=loaded.device)
    generator.manual_seed(choice_seed(params.seed, choice))
    return generator
