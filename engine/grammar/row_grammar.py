"""A constrained row's grammar state, and one step's masks for all constrained rows at once.

The sampler (engine/batch_sampler.py) calls :func:`apply_grammars` on the rows that have a
grammar only: their bitmasks filled on the host in one call (xgrammar's batch matcher, its own
threads), one copy to the device, applied to those rows' scores before penalties, temperature
and truncation, so the draw, the sampling mask and ``logprobs_mode: processed`` all see the
constraint; the raw logprobs are taken before it and stay the model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from engine.errors import InternalError
from engine.grammar.compiler import PendingGrammar

_BATCH = xgr.BatchGrammarMatcher(max_threads="auto")


class RowGrammar:
    """One row's matcher over its request's grammar, advanced by every token the row keeps."""

    def __init__(self, pending: PendingGrammar, stop_token_ids: Sequence[int]):
        self._pending = pending
        self._stop_ids = list(stop_token_ids)
        self._matcher: xgr.GrammarMatcher | None = None  # made at the first step: the grammar is compiled by then
        self._allowed: tuple[torch.Tensor, int] | None = None  # this step's bitmask (host) and its row there

    @property
    def vocab_size(self) -> int | None:
        return self._pending.vocab_size

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self._pending.wait(), max_rollback_tokens=0)
        return self._matcher

    @property
    def must_end(self) -> bool:
        """This step the grammar allows nothing but a stop token (min_tokens then holds no eos
        back). Read only by a row under min_tokens, so worked out only then."""
        if self._allowed is None:
            return False
        bitmask, row = self._allowed
        words = bitmask[row].clone()
        for token in self._stop_ids:
            if token // 32 < words.numel():
                words[token // 32] &= ~(1 << (token % 32))
        return not bool(words.any())

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
    _BATCH.batch_fill_next_token_bitmask([grammar.matcher for grammar in grammars], bitmask)
    extras: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for j, grammar in enumerate(grammars):
        grammar._allowed = (bitmask, j)
        if (extra := grammar._pending.extra_mask()) is not None:
            extras.setdefault(id(extra), (extra, []))[1].append(j)
    for extra, rows in extras.values():  # one AND per extra mask, over all its rows
        bitmask[rows] &= extra
    index = torch.tensor(list(indices), device=scores.device)
    rows = scores.index_select(0, index)
    xgr.apply_token_bitmask_inplace(rows, bitmask.to(rows.device, non_blocking=True))
    # Logits wider than the tokenizer's vocabulary (a padded head): the ids past it are no text.
    known = min(grammar.vocab_size or vocab for grammar in grammars)
    if known < vocab:
        rows[:, known:] = -torch.inf
    return scores.index_copy(0, index, rows)
