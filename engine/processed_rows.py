"""The processed distribution of a step's rows that asked for it (``SamplingParams.processed``):
each one's sampling mask and its token's processed logprob, for all of them in one pass.

The processed distribution is the one a row's token was drawn from: its logits after the
min_tokens mask and penalties (engine/decoding.py), no media placeholder
(engine/batch_sampler.py), then temperature, top-k, top-p and min-p (engine/sampling.py),
renormalized. Its support (the ids of non-zero probability) is the row's sampling mask for the
step; the log of it at the chosen token is the processed logprob (vLLM's processed_logprobs).
A greedy row's is a point mass: its support is its token alone and its token's logprob is 0.0.

Rows that asked for neither never reach this module: the draw's distribution is kept only on
steps where some row asked (engine/batch_sampler.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ProcessedRows:
    """The asked rows of one step, in the order given (``asked``)."""

    rows: torch.Tensor  # (m,) long: each one's row in the step's batch
    logprobs: torch.Tensor  # (m,) the chosen token's processed logprob
    top: tuple[torch.Tensor, torch.Tensor] | None  # values, ids (m, k): the processed top-k
    masks: list[np.ndarray | None]  # per asked row, its support's ids (int32, on the host), if it asked


def processed_rows(asked: Sequence[int], sampled: Sequence[int], sampled_probs: torch.Tensor | None,
                   tokens: torch.Tensor, *, top_k: int, masked: Sequence[bool]) -> ProcessedRows:
    """``asked``: the batch rows that asked; ``sampled``: the batch rows drawn by
    :func:`engine.sampling.draw_rows`, whose distributions are ``sampled_probs`` (one row each,
    in that order); every other asked row took its argmax (a point mass at ``tokens[row]``,
    answered without a vocabulary-sized tensor). ``top_k``: how many processed top logprobs to
    give; ``masked[j]``: asked row j wants its mask. The masks come to the host in one copy."""
    device, m = tokens.device, len(asked)
    position = {row: j for j, row in enumerate(sampled)}
    index = torch.tensor(asked, device=device)
    chosen = tokens.index_select(0, index)
    drawn = [j for j, row in enumerate(asked) if row in position]
    probs = _rows(sampled_probs, [position[asked[j]] for j in drawn]) if drawn else None
    if len(drawn) == m:  # no point mass among them (the usual case): no scatter
        logprobs, top = _drawn(probs, chosen, top_k)
    else:  # a point mass: its token at 0.0, every other id cut (-inf)
        logprobs = torch.zeros(m, device=device)
        values = torch.full((m, top_k), -math.inf, device=device)
        values[:, :1] = 0.0
        top = (values, chosen[:, None].repeat(1, top_k))
        if drawn:
            at = torch.tensor(drawn, device=device)
            drawn_logprobs, drawn_top = _drawn(probs, chosen.index_select(0, at), top_k)
            logprobs.index_copy_(0, at, drawn_logprobs)
            if top_k:
                top[0].index_copy_(0, at, drawn_top[0])
                top[1].index_copy_(0, at, drawn_top[1])
    wanted = [j for j, want in enumerate(masked) if want]
    return ProcessedRows(index, logprobs, top if top_k else None,
                         _masks(drawn, probs, chosen, wanted) if wanted else [None] * m)


def _rows(probs: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``probs[rows]``, without a copy when that is all of them in order."""
    if rows == list(range(len(probs))):
        return probs
    return probs.index_select(0, torch.tensor(rows, device=probs.device))


def _drawn(probs: torch.Tensor, chosen: torch.Tensor, top_k: int) -> tuple[torch.Tensor, tuple | None]:
    """The chosen tokens' logprobs and the top k (values, ids) under ``probs`` renormalized
    (the draw's are not: the exponential race needs no sum of 1)."""
    log_total = probs.sum(dim=-1, keepdim=True).log()
    logprobs = (probs.gather(1, chosen[:, None]).log() - log_total)[:, 0]
    if not top_k:
        return logprobs, None
    top = torch.topk(probs, top_k)  # the log keeps the order; only k of them are taken
    return logprobs, (top.values.log() - log_total, top.indices)


def _masks(drawn: list[int], probs: torch.Tensor | None, chosen: torch.Tensor,
           wanted: list[int]) -> list[np.ndarray | None]:
    """Each asked row's support ids (host, int32) where ``wanted``: a drawn row's from its
    ``probs`` (row ``drawn.index(j)``), a point mass's its token alone; all in one copy."""
    masks: list[np.ndarray | None] = [None] * len(chosen)
    at = {j: d for d, j in enumerate(drawn)}
    from_probs = [j for j in wanted if j in at]
    points = [j for j in wanted if j not in at]
    parts = []
    if from_probs:
        support = _rows(probs, [at[j] for j in from_probs]) > 0
        # Row-major, so each row's ids are a run, ascending: counts, ids, then the point masses.
        parts += [support.sum(dim=-1), support.nonzero()[:, 1]]
    if points:
        parts.append(chosen.index_select(0, torch.tensor(points, device=chosen.device)))
    host = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(torch.int32).cpu().numpy()
    ends = np.cumsum(host[:len(from_probs)]).tolist()
    ids = host[len(from_probs):]
    for j, start, end in zip(from_probs, [0, *ends][:len(ends)], ends, strict=True):
        masks[j] = ids[start:end]
    for j, token in zip(points, ids[len(ids) - len(points):], strict=True):
        masks[j] = np.array([token], dtype=np.int32)
    return masks
