"""The rows decoding together: their decoders, the jobs they belong to, and the left-padded KV
cache, mask, next positions, M-RoPE deltas and next input tokens, kept aligned row for row.

One object because these change together in three places (a decode step, rows joining after
their prefill, finished rows leaving): every change here keeps them the same length and order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.decoding import RowDecoder
from engine.kv_batch import append_rows, keep_rows
from engine.prompt_cache import PrefilledPrompt


@dataclass
class RunningBatch:
    rows: list[RowDecoder] = field(default_factory=list)
    jobs: list[Any] = field(default_factory=list)  # the scheduler's job of each row
    cache: Any = None
    mask: torch.Tensor | None = None  # (rows, width) attention mask of the cache
    positions: torch.Tensor | None = None  # (rows,) next text position
    deltas: torch.Tensor | None = None  # (rows,) M-RoPE deltas; None without M-RoPE
    last: torch.Tensor | None = None  # (rows,) token to feed next

    def __len__(self) -> int:
        return len(self.rows)

    def futures(self) -> list[tuple[int, int]]:
        """``(length now, steps left)`` of every row: what admission weighs a newcomer against."""
        return [(len(row.token_ids) + job.prompt_len, row.params.max_tokens - len(row.token_ids))
                for row, job in zip(self.rows, self.jobs, strict=True)]

    def decode_inputs(self) -> dict[str, Any]:
        """The next decode forward's inputs: each row's last token at its own position."""
        rows = len(self.rows)
        positions = self.positions[:, None]
        if self.deltas is not None:  # M-RoPE: text positions, then the three rotary axes shifted by the delta
            vision = (positions + self.deltas[:, None])[None].expand(3, rows, 1)
            positions = torch.cat([positions[None], vision], dim=0)
        return {"input_ids": self.last[:, None], "position_ids": positions, "cache": self.cache,
                "attention_mask": torch.cat([self.mask, self.mask.new_ones((rows, 1))], dim=1)}

    def advance(self, cache: Any, mask: torch.Tensor, tokens: torch.Tensor) -> None:
        """After a decode forward: its cache and mask, one position on, ``tokens`` to feed next."""
        self.cache, self.mask = cache, mask
        self.positions = self.positions + 1
        self.last = tokens.to(self.last.device)

    def join(self, rows: Sequence[RowDecoder], jobs: Sequence[Any], prompts: Sequence[PrefilledPrompt],
             tokens: torch.Tensor, *, config: Any, device: torch.device | str) -> None:
        """Rows whose prompts were just prefilled join, each with its first token ``tokens[i]``."""
        self.cache, self.mask = append_rows(self.cache, self.mask, [p.kv for p in prompts], config=config)
        positions = torch.tensor([p.length for p in prompts], dtype=torch.long, device=device)
        last = tokens.to(device)
        with_deltas = self.deltas is not None or any(p.rope_delta is not None for p in prompts)
        deltas = torch.tensor([p.rope_delta or 0 for p in prompts], dtype=torch.long, device=device)
        if self.positions is None:
            self.positions, self.last = positions, last
            self.deltas = deltas if with_deltas else None
        else:
            if with_deltas:
                before = self.deltas if self.deltas is not None else torch.zeros_like(self.positions)
                self.deltas = torch.cat([before, deltas])
            self.positions = torch.cat([self.positions, positions])
            self.last = torch.cat([self.last, last])
        self.rows += rows
        self.jobs += jobs

    def drop_finished(self) -> None:
        """Finished rows leave: the cache keeps the rest, trimmed to the longest of them."""
        keep = [i for i, row in enumerate(self.rows) if not row.done]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.jobs = [], []
            self.cache = self.mask = self.positions = self.deltas = self.last = None
            return
        self.cache, self.mask = keep_rows(self.cache, self.mask, keep)
        index = torch.as_tensor(keep, dtype=torch.long, device=self.positions.device)
        self.positions = self.positions.index_select(0, index)
        self.last = self.last.index_select(0, index)
        if self.deltas is not None:
            self.deltas = self.deltas.index_select(0, index)
        self.rows = [self.rows[i] for i in keep]
        self.jobs = [self.jobs[i] for i in keep]
