"""The batched sampler (sampling parameters: ``engine.sampling_params``): one call draws a token
for every sampled row of a step, with per-row temperature, top-k, top-p and min-p as tensors.

The draw is the exponential race (as vLLM's sampler draws): the token is ``argmax(probs / q)``
with ``q ~ Exp(1)`` per vocabulary entry, a draw from ``probs`` itself. A row with a ``seed``
draws its ``q`` from its own generator, so its tokens depend only on its logits, parameters and
seed, never on which rows share the batch (every other operation here works row by row: a row's
softmax, sort and cumulative sum give the same values whatever rows stand beside it); rows
without one share one draw from torch's default generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling_params import SamplingParams


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``.

    Mixed rather than ``seed + index`` so that choice 1 of seed s never equals choice 0 of s + 1.
    """
    words = np.random.SeedSequence(entropy=seed, spawn_key=(index,)).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


# A top_p this small keeps only the most likely token; below it fp32 reads the bound as 0 and would
# drop every token (an all-zero distribution, with nothing left to draw).
MIN_TOP_P = 1e-6


@dataclass(frozen=True)
class Draw:
    """One draw of a step's rows."""

    tokens: torch.Tensor  # (rows,) long: each row's token
    # (rows, vocab) fp32, not normalized: the distribution each row's token was drawn from, after
    # temperature, top-k, top-p and min-p (0 where a token was cut); a greedy row's is a point mass
    # at its token, as is a row whose distribution came out non-finite or empty.
    probs: torch.Tensor


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row (a long tensor of shape (rows,)) from fp32 logits (rows, vocab) (raw,
    or penalized by the caller); ``generators[i]``: row i's own (seeded rows), or None."""
    return draw_rows(logits, params, generators).tokens


def draw_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None]) -> Draw:
    """:func:`sample_rows`, with the processed distribution the tokens were drawn from."""
    device, vocab = logits.device, logits.shape[-1]
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    # Penalties with tiny factors can push logits to +-inf (and inf - inf to NaN): a NaN is no
    # token's score, and the largest finite ones stand for +-inf, so the softmax stays finite.
    finite_max = torch.finfo(logits.dtype).max
    scores = torch.nan_to_num(logits, nan=-math.inf, posinf=finite_max) / temperature[:, None]
    scores = scores.nan_to_num(nan=-math.inf, posinf=finite_max)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, device=device)
        kth = scores.sort(dim=-1, descending=True).values.gather(1, (k.clamp(min=1) - 1)[:, None])
        scores = scores.masked_fill((k[:, None] > 0) & (scores < kth), -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if any(p.top_p < 1 for p in params):
        top_p = torch.tensor([max(p.top_p, MIN_TOP_P) for p in params], device=device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the top one stays.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        probs = probs.masked_fill(torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted), 0.0)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    # Never a non-finite or empty distribution to the draw: the most likely token then. A greedy
    # row draws its point mass too (its token is ``best`` either way), so ``probs`` is what it
    # was drawn from at no extra cost.
    usable = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0) & ~greedy
    best = scores.argmax(dim=-1)
    probs = torch.where(usable[:, None], probs.nan_to_num(0.0),
                        torch.nn.functional.one_hot(best, vocab).to(probs.dtype))
    q = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        q.exponential_()
    else:
        if shared:
            q[shared] = torch.empty((len(shared), vocab), device=device).exponential_()
        for i, generator in enumerate(generators):
            if generator is not None:
                q[i].exponential_(generator=generator)
    # A zero q would turn a dropped token's 0 / 0 into NaN, which argmax takes for the largest.
    drawn = (probs / q.clamp_min(torch.finfo(q.dtype).tiny)).argmax(dim=-1)
    return Draw(torch.where(greedy, best, drawn), probs)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One row's token (0-d long tensor) from its fp32 logits (vocab,): :func:`sample_rows` of one."""
    return sample_rows(logits[None], [params], [generator])[0]
