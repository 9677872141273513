"""Per-row sampling and stopping, plugged into transformers' ``generate``.

``generate`` applies one sampling configuration and one RNG to the whole batch. To give every
row its own parameters and seed, the engine runs ``generate`` greedily and installs
:class:`RowSampler` as the only logits processor: it picks each row's token itself (from the
raw logits, with the row's parameters and ``torch.Generator``), records that token's logprob
under the raw distribution, and returns scores that are -inf everywhere but the picked token,
so the greedy step takes exactly it. :class:`RowStopper` ends each row on its own terms
(max_tokens, stop ids, eos unless ignore_eos, abort) and remembers why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, StoppingCriteria

from engine.sampling import SamplingParams, sample_row


@dataclass
class DecodeRow:
    request_index: int
    choice_index: int
    params: SamplingParams
    generator: torch.Generator | None  # None for greedy rows


@dataclass
class DecodeState:
    rows: Sequence[DecodeRow]
    prompt_width: int  # padded prompt length: generated token k sits at column prompt_width + k
    eos_token_ids: frozenset[int]
    fill_token_id: int
    should_abort: Callable[[], set[int]] | None = None
    done: list[bool] = field(init=False)
    finish_reasons: list[str | None] = field(init=False)
    lengths: list[int] = field(init=False)
    step_logprobs: list[torch.Tensor] = field(default_factory=list)  # one (rows,) tensor per step
    first_token_at: float | None = None  # perf_counter when the prefill's logits arrived

    def __post_init__(self) -> None:
        self.done = [False] * len(self.rows)
        self.finish_reasons = [None] * len(self.rows)
        self.lengths = [0] * len(self.rows)

    def logprobs(self) -> torch.Tensor:
        """(rows, steps) logprobs of the picked tokens, on the CPU."""
        return torch.stack(self.step_logprobs, dim=1).cpu()


class RowSampler(LogitsProcessor):
    def __init__(self, state: DecodeState):
        self.state = state

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        state = self.state
        if state.first_token_at is None:
            state.first_token_at = time.perf_counter()
        # ``scores`` are the raw fp32 logits: this is the only processor in the list.
        tokens = torch.argmax(scores, dim=-1)
        for i, row in enumerate(state.rows):
            if state.done[i]:
                tokens[i] = state.fill_token_id
            elif not row.params.greedy:
                tokens[i] = sample_row(scores[i], row.params, row.generator)
        picked = tokens[:, None]
        state.step_logprobs.append(torch.log_softmax(scores, dim=-1).gather(1, picked)[:, 0])
        return torch.full_like(scores, -math.inf).scatter_(1, picked, 0.0)


class RowStopper(StoppingCriteria):
    def __init__(self, state: DecodeState):
        self.state = state

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        state = self.state
        step = input_ids.shape[1] - state.prompt_width
        last = input_ids[:, -1].tolist()
        aborted = state.should_abort() if state.should_abort is not None else set()
        for i, row in enumerate(state.rows):
            if state.done[i]:
                continue
            reason = _finish_reason(last[i], step, row, state.eos_token_ids, aborted)
            if reason is not None:
                state.done[i] = True
                state.finish_reasons[i] = reason
                state.lengths[i] = step
        return torch.tensor(state.done, dtype=torch.bool, device=input_ids.device)


def _finish_reason(token: int, step: int, row: DecodeRow, eos: frozenset[int], aborted: set[int]) -> str | None:
    # The stop or eos token itself stays in the output: the trainer needs it and its logprob.
    if (token in eos and not row.params.ignore_eos) or token in row.params.stop_token_ids:
        return "stop"
    if step >= row.params.max_tokens:
        return "length"
    if row.request_index in aborted:
        return "abort"
    return None
