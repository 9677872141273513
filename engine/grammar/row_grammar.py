"""A constrained row's grammar state, and one step's masks for all constrained rows at once.

The sampler (engine/batch_sampler.py) calls :func:`apply_grammars` on the rows that have a
grammar only: their bitmasks filled on the host (xgrammar's matcher, microseconds a row), one
copy to the device, applied to those rows' scores before penalties, temperature and truncation,
so the draw, the sampling mask and ``logprobs_mode: processed`` all see the constraint; the raw
logprobs are taken before it and stay the model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from engine.errors import InternalError
from engine.grammar.compiler import PendingGrammar


class RowGrammar:
    """One row's matcher over its request's grammar, advanced by every token the row keeps."""

    def __init__(self, pending: PendingGrammar, stop_token_ids: Sequence[int]):
        self._pending = pending
        self._stop_ids = list(stop_token_ids)
        self._matcher: xgr.GrammarMatcher | None = None  # made at the first step: the grammar is compiled by then
        # The grammar allows nothing but a stop token now (min_tokens then holds no eos back).
        self.must_end = False

    @property
    def vocab_size(self) -> int:
        return self._pending.vocab_size

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self._pending.wait(), max_rollback_tokens=0)
        return self._matcher

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Row ``index`` of ``bitmask`` (host int32): the tokens the grammar allows next."""
        self.matcher.fill_next_token_bitmask(bitmask, index)
        if (extra := self._pending.extra_mask()) is not None:
            bitmask[index] &= extra
        words = bitmask[index].clone()
        for token in self._stop_ids:
            if token // 32 < words.numel():
                words[token // 32] &= ~(1 << (token % 32))
        self.must_end = not bool(words.any())

    def accept(self, token: int) -> None:
        """The row kept ``token``: the grammar moves past it. A token it did not allow means the
        mask was not applied: a bug, never silently continued."""
        if not self.matcher.accept_token(token):
            raise InternalError(f"token {token} was sampled outside the request's grammar")

    @property
    def terminated(self) -> bool:
        """The grammar ended (its stop token accepted): the row ends with finish_reason stop."""
        return self._matcher is not None and self._matcher.is_terminated()


def apply_grammars(scores: torch.Tensor, grammars: Sequence[RowGrammar], indices: Sequence[int]) -> torch.Tensor:
    """``scores`` (rows, vocab) with each row ``indices[j]`` limited to ``grammars[j]``'s allowed
    tokens (the rest -inf); a new tensor, ``scores`` untouched."""
    vocab = scores.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(indices), vocab)
    for j, grammar in enumerate(grammars):
        grammar.fill(bitmask, j)
    index = torch.tensor(list(indices), device=scores.device)
    rows = scores.index_select(0, index)
    xgr.apply_token_bitmask_inplace(rows, bitmask.to(rows.device, non_blocking=True))
    # Logits wider than the tokenizer's vocabulary (a padded head): the ids past it are no text.
    known = min(grammar.vocab_size or vocab for grammar in grammars)
    if known < vocab:
        rows[:, known:] = -torch.inf
    return scores.index_copy(0, index, rows)
