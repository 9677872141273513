"""The rows decoding together: their decoders, the jobs they belong to, and each row's block
table in the KV pool (:mod:`engine.paged_kv`), cache length, M-RoPE delta and next input token,
kept aligned row for row.

One object because these change together in three places (a decode step, rows joining after
their prefill, finished rows leaving): every change here keeps them the same length and order.
Rows join and leave by table edits: no K/V is copied, except a shared block a row is about to
write into (copy-on-write).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.capacity import RowFuture
from engine.decoding import RowDecoder
from engine.paged_kv import NULL_BLOCK, BlockPool, PagedStep, decode_mask
from engine.prompt_cache import PrefilledPrompt


class RunningBatch:
    def __init__(self, pool: BlockPool, *, attn_implementation: str | None = "sdpa",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 on_row_done: Callable[[RowDecoder, Any, list[int], int], None] | None = None):
        self.pool = pool
        self.on_row_done = on_row_done  # (row, job, blocks, length) of a finished row, before its blocks go back
        self.attn_implementation, self.dtype, self.device = attn_implementation, dtype, device
        self.rows: list[RowDecoder] = []
        self.jobs: list[Any] = []  # the scheduler's job of each row
        self.tables: list[list[int]] = []  # each row's blocks, in token order
        self.lengths: list[int] = []  # tokens each row holds in the cache (= its next text position)
        self.deltas: list[int] | None = None  # M-RoPE deltas; None without M-RoPE
        self.last: torch.Tensor | None = None  # (rows,) token to feed next

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def live_tokens(self) -> int:
        return sum(self.lengths)

    def futures(self) -> list[RowFuture]:
        """Every row's length now and steps left: what admission weighs a newcomer against. The
        rows of one request share their prompt's full blocks."""
        size = self.pool.block_size
        return [RowFuture(len(row.token_ids) + job.prompt_len, row.params.max_tokens - len(row.token_ids), id(job),
                          job.prompt_len // size)
                for row, job in zip(self.rows, self.jobs, strict=True)]

    def decode_inputs(self) -> dict[str, Any]:
        """The next decode forward's inputs: each row's last token at its own position, and the
        paged cache that writes its K/V into the row's next slot."""
        self._make_room()
        size = self.pool.block_size
        width = max(map(len, self.tables))
        table = self._to_device([t + [NULL_BLOCK] * (width - len(t)) for t in self.tables])
        writes = self._to_device([t[n // size] * size + n % size for t, n in zip(self.tables, self.lengths, strict=True)])
        lengths = self._to_device(self.lengths)
        positions = lengths[:, None]
        if self.deltas is not None:  # M-RoPE: text positions, then the three rotary axes shifted by the delta
            vision = (positions + self._to_device(self.deltas)[:, None])[None].expand(3, len(self.rows), 1)
            positions = torch.cat([positions[None], vision], dim=0)
        cache = PagedStep(self.pool, table, writes, max(self.lengths) + 1)
        mask = decode_mask(lengths, max(self.lengths) + 1, attn_implementation=self.attn_implementation,
                           dtype=self.dtype)
        return {"input_ids": self.last[:, None], "position_ids": positions, "cache": cache, "attention_mask": mask}

    def advance(self, tokens: torch.Tensor) -> None:
        """After a decode forward: every row one token longer, ``tokens`` to feed next."""
        self.lengths = [n + 1 for n in self.lengths]
        self.last = tokens.to(self.last.device)

    def join(self, rows: Sequence[RowDecoder], jobs: Sequence[Any], prompts: Sequence[PrefilledPrompt],
             tokens: torch.Tensor) -> None:
        """Rows whose prompts were just prefilled join, each with its first token ``tokens[i]``,
        sharing its prompt's blocks."""
        for prompt in prompts:
            self.pool.share(prompt.kv.blocks)
            self.tables.append(list(prompt.kv.blocks))
            self.lengths.append(prompt.length)
        if self.deltas is not None or any(p.rope_delta is not None for p in prompts):
            before = self.deltas if self.deltas is not None else [0] * len(self.rows)
            self.deltas = before + [p.rope_delta or 0 for p in prompts]
        last = tokens.to(self.device)
        self.last = last if self.last is None else torch.cat([self.last, last])
        self.rows += rows
        self.jobs += jobs

    def drop_finished(self) -> None:
        """Finished rows leave; their blocks go back to the pool (those no one else holds)."""
        keep = [i for i, row in enumerate(self.rows) if not row.done]
        if len(keep) == len(self.rows):
            return
        for i, row in enumerate(self.rows):
            if row.done:
                if self.on_row_done is not None:
                    self.on_row_done(row, self.jobs[i], self.tables[i], self.lengths[i])
                self.pool.release(self.tables[i])
        self._keep(keep)

    def evict(self, job: Any) -> None:
        """``job``'s rows leave unfinished (preempted: engine/preemption.py); their blocks go back,
        their full ones named as a finished row's (``on_row_done``), so its resume finds them."""
        keep = [i for i, j in enumerate(self.jobs) if j is not job]
        for i, j in enumerate(self.jobs):
            if j is job:
                if self.on_row_done is not None:
                    self.on_row_done(self.rows[i], job, self.tables[i], self.lengths[i])
                self.pool.release(self.tables[i])
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.jobs = [self.jobs[i] for i in keep]
        self.tables = [self.tables[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if self.deltas is not None:
            self.deltas = [self.deltas[i] for i in keep] if keep else None
        self.last = self.last.index_select(0, torch.as_tensor(keep, dtype=torch.long, device=self.last.device)) \
            if keep else None

    def _to_device(self, values: list) -> torch.Tensor:
        """A step's small host-side numbers on the device without a host sync (a CUDA copy from
        pageable memory with ``non_blocking`` does not wait on the stream; the sampler's one copy
        back is the step's only sync)."""
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _make_room(self) -> None:
        """Every row's next slot in a block of its own: a new block at a block's end (the step's
        new blocks taken in one call, so they are cleared together), a private copy of a block
        another row holds or the cache names (its prompt's last one: a named block's K/V is final)."""
        pool, size = self.pool, self.pool.block_size
        growing = [table for table, length in zip(self.tables, self.lengths, strict=True) if length // size == len(table)]
        if growing:
            for table, block in zip(growing, pool.allocate(len(growing)), strict=True):
                table.append(block)
        for table, length in zip(self.tables, self.lengths, strict=True):
            index = length // size
            block = table[index]
            if not pool.is_shared(block) and pool.is_named(block) and not pool.free:
                pool.forget(block)  # no block to copy into: the cache loses it, the row writes in place
            if pool.is_shared(block) or pool.is_named(block):
                private = pool.allocate(1)[0]
                pool.copy_block(block, private)
                pool.release([block])
                table[index] = private
