"""Per-row decoding state: what one choice of one request needs from its first token to its end.

Everything a row needs lives in its :class:`RowDecoder` (parameters, seeded generator, penalty
counts, text, logprobs, finish): nothing assumes the rows of a batch start or end together, and
the scheduler (:mod:`engine.scheduler`) drives these objects while rows join and leave between
decode steps.

Per step and row, in vLLM's order: a structured output's grammar mask (engine/grammar/), the
min-tokens mask (eos and stop ids to -inf) and the penalties (:mod:`engine.penalties`), both
:meth:`RowDecoder.adjust`, then temperature and
truncation, batched over the step's rows (:func:`engine.sampling.sample_rows`).
Logprobs, the sampled token's and the top-k alternatives, are of the raw logits before all of it,
or, under ``logprobs_mode`` "processed", of the distribution the token was drawn from after all of
it (engine/processed_rows.py); with ``sampling_mask`` each token's support is kept too
(engine/sampling_mask.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.detokenize import IncrementalText, decode_text, find_stop
from engine.penalties import RowPenalties
from engine.routing.rows import RowRouting
from engine.row_versions import RowVersions
from engine.sampling_mask import SamplingMasks
from engine.sampling_params import SamplingParams


class RowDecoder:
    """One choice of one request, from its first decode step to its finish."""

    def __init__(self, request_index: int, choice_index: int, params: SamplingParams,
                 generator: torch.Generator | None, *, prompt_token_ids: Sequence[int] = (),
                 eos_token_ids: frozenset[int] = frozenset(), tokenizer: Any = None, weight_version: str = "",
                 adapter: str = "", grammar: Any = None):
        self.request_index = request_index
        self.choice_index = choice_index
        self.params = params
        self.generator = generator  # None for greedy rows
        self.tokenizer = tokenizer
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        # vLLM masks eos under min_tokens even with ignore_eos (it is in all_stop_token_ids).
        self._min_tokens_ids = sorted(frozenset(params.stop_token_ids) | eos_token_ids)
        self._penalties = RowPenalties(params, prompt_token_ids) if params.penalized else None
        self._text = None
        if params.stop:
            self._text = IncrementalText(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                         spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None
        self._stop_text: str | None = None  # the text cut at the matched stop string
        self._logprobs: list[float] = []
        self._top_values: list[torch.Tensor] = []
        self._top_ids: list[torch.Tensor] = []
        self._masks = SamplingMasks() if params.sampling_mask else None
        self.versions = RowVersions(weight_version, adapter)  # which weights made each token (engine/row_versions.py)
        # engine.grammar.row_grammar.RowGrammar: the request's constraint, applied by the sampler
        # before everything else this row adjusts; None for a free row.
        self.grammar = grammar
        # The experts each of its positions took (engine/routing/); None unless it asked.
        self.routing = RowRouting() if params.routed_experts else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def adjusts(self) -> bool:
        """This step's logits need :meth:`adjust` (a penalty, or the min_tokens mask)."""
        return self._penalties is not None or self._holds_stops

    @property
    def _holds_stops(self) -> bool:
        """min_tokens holds eos and the stop ids back this step: not once the row's grammar
        allows nothing but its end (the constraint decides the length then)."""
        return (len(self.token_ids) < self.params.min_tokens and bool(self._min_tokens_ids)
                and not (self.grammar is not None and self.grammar.must_end))

    def adjust(self, raw: torch.Tensor) -> torch.Tensor:
        """The row's fp32 logits (vocab,) with the min_tokens mask and its penalties applied."""
        logits = raw
        if self._holds_stops:
            ids = [t for t in self._min_tokens_ids if t < raw.shape[-1]]
            logits = logits.index_fill(0, torch.as_tensor(ids, device=raw.device), -math.inf)
        if self._penalties is not None:
            logits = self._penalties.apply(logits)
        return logits

    def note_sampled(self, token: torch.Tensor) -> None:
        """The token drawn this step (0-d long tensor, still on the device): the penalties count it."""
        if self._penalties is not None:
            self._penalties.add(token)

    def add_logprobs(self, logprob: float, top_values: torch.Tensor | None, top_ids: torch.Tensor | None) -> None:
        """The sampled token's logprob, and the top-k (on the device until the end)."""
        self._logprobs.append(logprob)
        if top_values is not None:
            self._top_values.append(top_values)
            self._top_ids.append(top_ids)

    def add_mask(self, token_ids: np.ndarray) -> None:
        """This step's sampling mask: the ids its token could have been drawn from (host, int32)."""
        self._masks.add(token_ids)

    def record(self, token: int, *, aborted: bool) -> None:
        """The token this step produced (on the host); decides whether the row ends here."""
        if self.grammar is not None:
            self.grammar.accept(token)
        self.token_ids.append(token)
        step = len(self.token_ids)
        new_text = self._text.push(token) if self._text is not None else ""
        params = self.params
        if token in self._stop_ids:
            # The stop or eos token itself stays in the output: the trainer needs it and its logprob.
            self._finish("stop", token)
        elif self.grammar is not None and self.grammar.terminated:  # its stop token, under ignore_eos
            self._finish("stop", token)
        elif new_text and step > params.min_tokens and (match := find_stop(self._text.text, len(new_text),
                                                                            params.stop)):
            index, stop = match
            self._stop_text = self._text.text[: index + len(stop) if params.include_stop_str_in_output else index]
            self._finish("stop", stop)
        elif step >= params.max_tokens:
            self._finish("length")
        elif aborted:
            self._finish("abort")

    def abort(self, reason: str = "abort") -> None:
        """End the row now with the tokens so far (a cancel, a deadline, or its request's error;
        ``"policy_lag"``: a weight swap it may not cross)."""
        if not self.done:
            self._finish(reason)

    def _finish(self, reason: str, matched: int | str | None = None) -> None:
        self.finish_reason = reason
        self.matched_stop = matched

    def text(self) -> str | None:
        """The returned text: cut at a matched stop string, without a matched stop token's
        text, unless include_stop_str_in_output."""
        params = self.params
        if not params.detokenize or self.tokenizer is None:
            return None
        if self._stop_text is not None:
            return self._stop_text
        ids = self.token_ids
        if isinstance(self.matched_stop, int) and not params.include_stop_str_in_output:
            ids = ids[:-1]
        return decode_text(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                           spaces_between_special_tokens=params.spaces_between_special_tokens)

    def logprobs(self) -> list[float] | None:
        if not self.params.logprobs:
            return None
        return list(self._logprobs)

    def top_logprobs(self) -> list[list[list]] | None:
        """Per token, ``[[token_id, logprob], ...]`` of the k most likely tokens, most likely first.

        Under ``logprobs_mode`` "processed" these are the top k of the processed distribution, and
        only tokens in its support: a step whose support is smaller than k lists fewer (a greedy
        step lists its token alone, at 0.0), as a cut token has no finite logprob to give."""
        if not self.params.top_logprobs:
            return None
        if not self._top_values:
            return []
        values, ids = torch.stack(self._top_values).tolist(), torch.stack(self._top_ids).tolist()
        cut = -math.inf if self.params.logprobs_mode == "processed" else None
        return [[[t, v] for t, v in zip(step_ids, step_values, strict=True) if v != cut]
                for step_ids, step_values in zip(ids, values, strict=True)]

    def sampling_mask(self) -> dict[str, list[int]] | None:
        """CSR over the tokens (engine/sampling_mask.py) when the request asked, else None."""
        return self._masks.csr() if self._masks is not None else None

    def packed_sampling_mask(self) -> dict[str, str] | None:
        """:meth:`sampling_mask` packed as a result stores it (engine/sampling_mask.py ``pack``)."""
        return self._masks.packed() if self._masks is not None else None
