"""Prefix reuse in the KV pool, for the scheduler: a prompt's blocks found again by their names
(:mod:`engine.prefix_hash`), and the blocks a prefill computed or a row decoded named so later
requests find them. A prompt found whole (every block, and its last logits in
:class:`engine.prompt_cache.PromptEnds`) joins with no forward; another starts its prefill after
the longest run of full blocks it finds (:func:`engine.prefill_plan.reusable_blocks`)."""

from __future__ import annotations

from engine.decoding import RowDecoder
from engine.paged_kv import BlockPool, PagedPrompt
from engine.prefill_plan import reusable_blocks
from engine.prefix_hash import MediaSpan, chain
from engine.prompt_cache import PrefilledPrompt, PromptEnds
from engine.scheduled_requests import Job


class PrefixCache:
    def __init__(self, pool: BlockPool, prompt_ends: PromptEnds):
        self.pool, self.prompt_ends = pool, prompt_ends

    def find(self, job: Job) -> PrefilledPrompt | None:
        """``job``'s prompt found whole in the pool (every block, and its last logits: it joins with
        no forward; the caller releases the prompt's reference after its rows joined), or None,
        having taken the cached blocks its prefill starts from (``job.prefix``)."""
        self.drop(job)  # what it held while it waited may have grown
        names, pool = job.names, self.pool
        if names is None:
            return None
        every = [*names.full, names.tail] if names.tail is not None else list(names.full)
        end = self.prompt_ends.get(names.last)
        if end is not None and len(blocks := pool.cached_run(every)) == len(every):
            pool.share(blocks)
            return PrefilledPrompt(PagedPrompt(pool, blocks, job.prompt_len), end.logits, end.rope_delta,
                                   job.prompt_len)
        found = pool.cached_run(names.full)
        count = reusable_blocks(len(found), pool.block_size, job.prompt_len, [unit.span for unit in job.units])
        job.prefix, job.prefix_tokens = found[:count], count * pool.block_size
        pool.share(job.prefix)
        return None

    def drop(self, job: Job) -> None:
        """Give back the cached blocks ``job`` held for its prefill."""
        self.pool.release(job.prefix)
        job.prefix, job.prefix_tokens = [], 0

    def keep(self, job: Job, prompt: PrefilledPrompt) -> None:
        """Name a computed prompt's blocks and keep its last logits, so later requests find it
        (never a prompt whose forward went non-finite)."""
        names = job.names
        if names is None or not prompt.finite:
            return
        for block, name in zip(prompt.kv.blocks, [*names.full, names.tail], strict=False):
            if name is not None:
                self.pool.name(block, name)
        self.prompt_ends.put(names.last, prompt)

    def keep_decoded(self, row: RowDecoder, job: Job, table: list[int], length: int) -> None:
        """A finished row's full blocks past its prompt's, named by its prompt and the tokens it
        decoded: the next turn of an agent, which repeats them, computes none of them again. A row
        that lived through a weight swap holding the old weights' KV names none: its blocks are
        neither version's computation (engine/weight_crossing.py)."""
        names, size = job.names, self.pool.block_size
        if names is None or job.error is not None or length // size <= len(names.full):
            return
        if row.versions.crossed and not row.versions.kv_recomputed():
            return
        tokens = [*job.request.prompt_token_ids, *row.token_ids][:length]
        parent = names.full[-1] if names.full else names.root
        first = len(names.full)
        spans = [MediaSpan(*unit.span, unit.key) for unit in job.units]
        for block, name in zip(table[first:], chain(parent, tokens, size, spans, first_block=first), strict=False):
            self.pool.name(block, name)
