"""vLLM's sampling names (shared by its OpenAI-compatible bodies and its SamplingParams) onto ours.

Field names and meanings follow vLLM's ``vllm/sampling_params.py`` (SamplingParams) and the
``extra`` fields of ``vllm/entrypoints/openai/protocol.py`` (CompletionRequest,
ChatCompletionRequest): ``top_k`` -1, 0 or at least the vocabulary is off, ``stop`` a string or a list.
"""

from __future__ import annotations

from typing import Any

from flask import has_app_context
from marshmallow import fields, validate

from web.api.schemas import StrictBoolean, StrictFloat
from web.dialects.fields import OneOrMany
from web.dialects.structured import vllm_structured
from web.services import services

# Same name, same meaning, in vLLM and in our native sampling_params.
SAME = ("temperature", "top_p", "min_p", "n", "seed", "min_tokens", "stop_token_ids", "ignore_eos",
        "include_stop_str_in_output", "repetition_penalty", "frequency_penalty", "presence_penalty",
        "skip_special_tokens", "spaces_between_special_tokens", "prompt_logprobs", "detokenize", "max_policy_lag")


def sampling_fields() -> dict[str, fields.Field]:
    """The marshmallow fields of these knobs (types only: the native schema checks ranges)."""
    return {
        "temperature": StrictFloat(allow_nan=False), "top_p": StrictFloat(allow_nan=False),
        "top_k": fields.Integer(strict=True, metadata={"description": "-1, 0 or >= the vocabulary: off"}),
        "min_p": StrictFloat(allow_nan=False), "n": fields.Integer(strict=True),
        "seed": fields.Integer(strict=True), "min_tokens": fields.Integer(strict=True),
        "stop": OneOrMany(fields.String()), "stop_token_ids": fields.List(fields.Integer(strict=True)),
        "ignore_eos": StrictBoolean(), "include_stop_str_in_output": StrictBoolean(),
        "repetition_penalty": StrictFloat(allow_nan=False), "frequency_penalty": StrictFloat(allow_nan=False),
        "presence_penalty": StrictFloat(allow_nan=False), "skip_special_tokens": StrictBoolean(),
        "spaces_between_special_tokens": StrictBoolean(),
        "prompt_logprobs": fields.Integer(strict=True, validate=validate.Range(0, 20)),
        "max_policy_lag": fields.Integer(strict=True, allow_none=True,
                                         metadata={"description": "ours: weight updates a row may cross"}),
        # vLLM sets these two server-wide (--logprobs-mode, --return-sampling-mask: its PR #49577);
        # here a request sets them, under the same names.
        "logprobs_mode": fields.String(validate=validate.OneOf(
            list(LOGPROBS_MODES), error="one of raw_logprobs, processed_logprobs (the *_logits modes are not served)")),
        "return_sampling_mask": StrictBoolean(metadata={
            "description": "Per token, the ids it could have been drawn from (choices[].sampling_mask)"}),
        "return_routed_experts": StrictBoolean(metadata={
            "description": "MoE models: every position's top-k expert ids per MoE layer (choices[].routed_experts, "
                           "vLLM's [tokens][layers][k] lists)"}),
    }


# vLLM's --logprobs-mode values served here -> ours.
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
# Our sampling_params names for vLLM's, where they differ (error messages name what was sent).
RENAMED = {"sampling_mask": "return_sampling_mask", "routed_experts": "return_routed_experts"}


def _server_returns_routed_experts() -> bool:
    """ROLLOUT_RETURN_ROUTED_EXPERTS on an MoE model: vLLM's server flag, every choice carries them."""
    if not has_app_context():
        return False
    svc = services()
    return svc.settings.return_routed_experts and svc.model_facts.routed_bytes_per_token > 0


def top_k_of(top_k: int, vocab_size: int | None) -> int:
    """Our ``top_k`` for vLLM's or SGLang's: -1 (off) for -1, 0 or at least the vocabulary (both
    engines keep every token then; AReaL sends 100000000 to mean "no top-k")."""
    off = top_k in (-1, 0) or (vocab_size is not None and top_k >= vocab_size)
    return -1 if off else top_k


def native_sampling(body: dict[str, Any], vocab_size: int | None) -> dict[str, Any]:
    """Our sampling_params from the vLLM-named knobs in ``body`` (absent ones keep our defaults)."""
    out = {name: body[name] for name in SAME if name in body}
    if "stop" in body:
        out["stop"] = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
    if "top_k" in body:
        out["top_k"] = top_k_of(body["top_k"], vocab_size)
    if "max_tokens" in body:
        out["max_tokens"] = body["max_tokens"]
    if "logprobs_mode" in body:
        out["logprobs_mode"] = LOGPROBS_MODES[body["logprobs_mode"]]
    if "return_sampling_mask" in body:
        out["sampling_mask"] = body["return_sampling_mask"]
    if "return_routed_experts" in body:
        out["routed_experts"] = body["return_routed_experts"]
    elif _server_returns_routed_experts():
        out["routed_experts"] = True
    if (constraint := vllm_structured(body)) is not None:  # structured_outputs, guided_*
        out["structured_output"] = constraint
    return out
