"""Repetition, frequency and presence penalties of one row, as vLLM's sampler defines them.

Matched against vLLM's ``apply_penalties`` in ``vllm/model_executor/layers/utils.py`` (the
formula its v1 sampler applies, after the min-tokens mask and before temperature):

- repetition penalty ``r`` over every token id seen in the prompt or the output so far: a
  positive logit is divided by ``r``, any other multiplied by ``r``;
- frequency penalty ``f``: ``f`` times the token's count in the output is subtracted;
- presence penalty ``p``: ``p`` is subtracted once from every token present in the output.

The prompt counts for the repetition penalty only, as in vLLM. The state is one row's own
(its prompt mask and output counts on the logits' device, updated without a host sync), so a
row can join or leave a batch between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams

MIN_REPETITION_PENALTY = 1e-6


class RowPenalties:
    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int]):
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.counts: torch.Tensor | None = None  # (vocab,) float: times each id was generated
        self.prompt_mask: torch.Tensor | None = None  # (vocab,) bool: ids in the prompt

    def _init(self, logits: torch.Tensor) -> None:
        vocab = logits.shape[-1]
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=logits.device)
        self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        ids = [t for t in self.prompt_token_ids if 0 <= t < vocab]
        if ids:
            self.prompt_mask[torch.as_tensor(ids, device=logits.device)] = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The penalized copy of one row's fp32 logits (vocab,)."""
        if self.counts is None:
            self._init(logits)
        params = self.params
        present = self.counts > 0
        if params.repetition_penalty != 1:
            seen = present | self.prompt_mask
            # Floored: 1e-300 is 0 in fp32, and a logit divided by it is inf (the sampler copes, but
            # a factor past this one already makes a seen token certain or impossible).
            factor = max(params.repetition_penalty, MIN_REPETITION_PENALTY)
            penalized = torch.where(logits > 0, logits / factor, logits * factor)
            logits = torch.where(seen, penalized, logits)
        if params.frequency_penalty != 0:
            logits = logits - params.frequency_penalty * self.counts
        if params.presence_penalty != 0:
            logits = logits - params.presence_penalty * present.to(logits.dtype)
        return logits

    def add(self, token: torch.Tensor) -> None:
        """Count a generated token (a 0-d long tensor on the logits' device)."""
        if self.counts is not None:
            self.counts.index_add_(0, token.view(1), torch.ones(1, device=self.counts.device))
