"""Sampling parameters and the per-row sampler.

A row is sampled from its own logits with its own ``torch.Generator``, one row at a time, so a
sampled token depends only on that row's logits, parameters and seed, never on which other
requests share the batch (a batched softmax or sort may round differently with the batch shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.errors import InvalidRequestError

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = True  # return the logprob of each sampled token

    def __post_init__(self) -> None:
        # Lists from JSON become a tuple so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problems = {}
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            problems["max_tokens"] = "must be an integer >= 1"
        if not _is_real(self.temperature) or self.temperature < 0:
            problems["temperature"] = "must be a finite number >= 0"
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            problems["top_p"] = "must be in (0, 1]"
        if not _is_int(self.top_k) or self.top_k < 0:
            problems["top_k"] = "must be an integer >= 0 (0 disables it)"
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            problems["min_p"] = "must be in [0, 1]"
        if not _is_int(self.n) or self.n < 1:
            problems["n"] = "must be an integer >= 1"
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            problems["seed"] = f"must be an integer in [0, {MAX_SEED}]"
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            problems["stop_token_ids"] = "must be non-negative integers"
        if not isinstance(self.ignore_eos, bool):
            problems["ignore_eos"] = "must be a boolean"
        if not isinstance(self.logprobs, bool):
            problems["logprobs"] = "must be a boolean"
        if problems:
            raise InvalidRequestError("invalid sampling parameters", errors=problems)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``.

    Mixed rather than ``seed + index`` so that choice 1 of seed s never equals choice 0 of s + 1.
    """
    words = np.random.SeedSequence(entropy=seed, spawn_key=(index,)).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token id (a 0-d long tensor) from one row of raw fp32 logits of shape (vocab,)."""
    if params.greedy:
        return torch.argmax(logits)
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the top one stays.
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        probs = probs.masked_fill(torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted), 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return torch.multinomial(probs, 1, generator=generator)[0]


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
