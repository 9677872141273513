"""Sampling parameters: every per-request knob the engine honours, and their bounds.

Free of torch, so the API validates requests against the same bounds without importing it; the
sampler that applies them is ``engine.sampling``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.errors import InvalidRequestError
from engine.grammar.spec import GrammarSpec
from engine.request_rules import sampling_knob_problems

MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs: k alternatives per step cost k floats per token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
# A temperature below this samples greedily, as vLLM's and SGLang's samplers do (_SAMPLING_EPS):
# dividing logits by 1e-40 (or 5e-324) overflows fp32 to inf and the softmax to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
# Which distribution logprobs are of: "raw", the model's (the default: importance ratios over the
# whole vocabulary), or "processed", the one each token was drawn from (vLLM's processed_logprobs).
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    """Every per-request knob the engine honours, under one internal name each.

    Dialect adapters map their field names onto these (SGLang's ``max_new_tokens`` ->
    ``max_tokens``, ``min_new_tokens`` -> ``min_tokens``, ``no_stop_trim`` ->
    ``include_stop_str_in_output``, ``top_logprobs_num`` -> ``top_logprobs``; vLLM's integer
    ``logprobs`` -> ``logprobs=True`` plus ``top_logprobs``). Semantics follow vLLM's sampler.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = True  # return the logprob of each sampled token
    # Stopping on text: the first of these strings to appear in the detokenized output ends the
    # choice (finish_reason "stop", matched_stop = the string). The string (or the stop token's
    # text) is cut from the returned text unless include_stop_str_in_output.
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    # No eos or stop token id can be sampled, and no stop string matches, before this many tokens.
    min_tokens: int = 0
    # vLLM's penalties (engine.penalties): repetition over prompt + output, the others over output.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_logprobs: int = 0  # per step, this many most likely tokens of the logprobs_mode distribution
    # One of LOGPROBS_MODES (engine/processed_rows.py); prompt logprobs stay raw (nothing is drawn there).
    logprobs_mode: str = "raw"
    # Per token, the ids the token could have been drawn from (vLLM's SamplingMask, SGLang's
    # output_token_sampling_mask): Choice.sampling_mask.
    sampling_mask: bool = False
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and top k
    detokenize: bool = True  # return the choice's text
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # The most weight updates a row may live through (update mode keep); one more ends it with
    # finish_reason "policy_lag" before any token of the newer weights. None: no bound.
    max_policy_lag: int | None = None
    # A constraint every token obeys (engine/grammar/): the native ``structured_output`` object
    # (one of json_schema, json_object, regex, choice, grammar) or its GrammarSpec. None: free.
    structured_output: GrammarSpec | None = None
    # Per prompt and output token, the top-k expert ids of every MoE layer (rollout routing replay:
    # engine/routing/): Choice.routed_experts. Only for a model with MoE layers.
    routed_experts: bool = False

    def __post_init__(self) -> None:
        # Lists from JSON become a tuple so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
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
        for name in ("logprobs", "include_stop_str_in_output", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "sampling_mask", "routed_experts"):
            if not isinstance(getattr(self, name), bool):
                problems[name] = "must be a boolean"
        if (len(self.stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop)):
            problems["stop"] = (f"at most {MAX_STOP_STRINGS} non-empty strings of at most "
                                f"{MAX_STOP_STRING_CHARS} characters")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            problems["min_tokens"] = "must be an integer >= 0"
        problems = {**sampling_knob_problems(vars(self)), **problems}  # a field's own range first
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            problems["repetition_penalty"] = "must be in (0, 2] (1 turns it off)"
        for name in ("frequency_penalty", "presence_penalty"):
            if not _is_real(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                problems[name] = "must be in [-2, 2] (0 turns it off)"
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            problems["top_logprobs"] = f"must be an integer in [0, {MAX_TOP_LOGPROBS}]"
        if not isinstance(self.logprobs_mode, str) or self.logprobs_mode not in LOGPROBS_MODES:
            problems["logprobs_mode"] = f"must be one of {', '.join(LOGPROBS_MODES)}"
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            problems["prompt_logprobs"] = f"must be null or an integer in [0, {MAX_TOP_LOGPROBS}]"
        if self.max_policy_lag is not None and (not _is_int(self.max_policy_lag) or self.max_policy_lag < 0):
            problems["max_policy_lag"] = "must be null or an integer >= 0"
        if problems:
            raise InvalidRequestError("invalid sampling parameters", errors=problems)
        if self.structured_output is not None:  # its own typed refusals (invalid_grammar, grammar_too_complex)
            object.__setattr__(self, "structured_output", GrammarSpec.from_request(self.structured_output))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def processed(self) -> bool:
        """The sampler hands this row its processed distribution (engine/processed_rows.py)."""
        return self.sampling_mask or self.logprobs_mode == "processed"

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
