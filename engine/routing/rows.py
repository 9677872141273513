"""One row's routed experts as its forwards record them: for every position fed to the model
(prompt tokens, then each output token but the last, which is never fed), the top-k expert ids of
every MoE layer. A decode step's ids are one host array for the whole batch (a non-blocking
copy), each row holding a reference and its index; a row's are stacked when its result is built.

A position recorded twice (a preempted row's resume, a row whose KV the new weights computed
again after an update) keeps its first record: the experts of the weights that computed the
token when it ran."""

from __future__ import annotations

import numpy as np
import torch


class RowRouting:
    def __init__(self) -> None:
        self._pieces: list[tuple[np.ndarray, int | None]] = []  # (step ids, row) or (ids[n], None)
        self.filled = 0  # positions 0 .. filled - 1 are recorded

    def add_positions(self, start: int, ids: torch.Tensor | None) -> None:
        """``ids`` (n, layers, k) for positions ``start .. start + n - 1``; only those past what
        is recorded count."""
        if ids is None or start + ids.shape[0] <= self.filled:
            return
        if start > self.filled:
            raise RuntimeError(f"routing for position {start} before {self.filled} was recorded")
        self._pieces.append((ids[self.filled - start:].cpu().numpy(), None))
        self.filled = start + ids.shape[0]

    def add_step(self, position: int, step: np.ndarray, row: int) -> None:
        """A decode step's ids (rows, layers, k): this row's is ``step[row]``, at ``position``."""
        if position < self.filled:
            return
        if position > self.filled:
            raise RuntimeError(f"routing for position {position} before {self.filled} was recorded")
        self._pieces.append((step, row))
        self.filled += 1

    def array(self, positions: int) -> np.ndarray:
        """The first ``positions`` positions' ids, (positions, layers, k), on the host."""
        if positions > self.filled:
            raise RuntimeError(f"routing asked for {positions} positions, {self.filled} recorded")
        parts = [ids if row is None else ids[row:row + 1] for ids, row in self._pieces]
        return np.concatenate(parts)[:positions]
