"""The per-row sampler (sampling parameters: ``engine.sampling_params``).

A row is sampled from its own logits with its own ``torch.Generator``, one row at a time, so a
sampled token depends only on that row's logits, parameters and seed, never on which other
requests share the batch (a batched softmax or sort may round differently with the batch shape).
"""

from __future__ import annotations

import math

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
# drop every token (an all-zero distribution: torch.multinomial raises, and on CUDA asserts).
MIN_TOP_P = 1e-6


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token id (a 0-d long tensor) from one row of fp32 logits of shape (vocab,) (raw, or
    penalized by the caller)."""
    if params.greedy:
        return torch.argmax(logits)
    # Penalties with tiny factors can push logits to +-inf (and inf - inf to NaN): a NaN is no
    # token's score, and the largest finite ones stand for +-inf, so the softmax stays finite.
    scores = torch.nan_to_num(logits, nan=-math.inf, posinf=torch.finfo(logits.dtype).max) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = torch.softmax(scores.nan_to_num(nan=-math.inf, posinf=torch.finfo(scores.dtype).max), dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the top one stays.
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= max(params.top_p, MIN_TOP_P)
        probs = probs.masked_fill(torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted), 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    # Never a non-finite or empty distribution to the draw: the most likely token then.
    usable = torch.isfinite(probs).all() & (probs.sum() > 0)
    probs = torch.where(usable, probs.nan_to_num(0.0), torch.nn.functional.one_hot(
        torch.argmax(scores), probs.shape[-1]).to(probs.dtype))
    return torch.multinomial(probs, 1, generator=generator)[0]
