"""The request rules more than one layer checks, each written once.

The API checks a request as soon as it arrives; a later layer checks again what only it can see
(the prompt length once media placeholders are expanded, the items a features payload holds) or
what reaches it by another way (a render, a batch line). Both call the same function here, the
lowest layer, so the rule, its error code and its wording are the same wherever it trips.
Free of torch: the API imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.errors import ContextLengthError, InvalidRequestError


class TooManyContentPartsError(InvalidRequestError):
    code = "too_many_content_parts"


def prompt_input_problem(request: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(field, message)`` when a request's prompt and media do not go together, else None: one
    of ``token_ids`` and ``prompt``, and ``content_parts`` or ``features`` (not both)."""
    if (request.get("token_ids") is not None) == (request.get("prompt") is not None):
        return "token_ids", "give exactly one of token_ids or prompt"
    if request.get("content_parts") and request.get("features") is not None:
        return "features", "content_parts and features are mutually exclusive: send one"
    return None


def check_prompt_input(request: Mapping[str, Any]) -> None:
    """:func:`prompt_input_problem` as an InvalidRequestError (422) naming the field."""
    if problem := prompt_input_problem(request):
        field, message = problem
        raise InvalidRequestError(message, errors={field: [message]})


def check_media_count(count: int, limit: int, what: str = "content parts") -> None:
    """At most ``limit`` media items (content parts, or a features payload's entries)."""
    if count > limit:
        raise TooManyContentPartsError(f"{count} {what}; at most {limit} are accepted",
                                       errors={"count": count, "limit": limit})


def context_limit(configured: int | None, model_context: int | None) -> int | None:
    """The one context limit every layer checks a request against: ``ROLLOUT_MAX_MODEL_LEN`` when
    set (never past the model's own context), else the model's (None: neither is known)."""
    if configured is None:
        return model_context
    return configured if model_context is None else min(configured, model_context)


def new_tokens_of(kind: str, max_tokens: int, completion_token_ids) -> int:
    """The tokens a request adds to its prompt: a score job's completion, or up to max_tokens."""
    return len(completion_token_ids or ()) if kind == "score" else max_tokens


def check_context(prompt_tokens: int, new_tokens: int, limit: int | None, *, prompt: str = "prompt") -> None:
    """The prompt plus the tokens it may add must fit the context of ``limit`` tokens (None: no
    limit). ``prompt`` names what was counted (e.g. the prompt with its placeholders expanded)."""
    if limit is None or prompt_tokens + new_tokens <= limit:
        return
    added = f" plus {new_tokens} new tokens" if new_tokens else ""
    raise ContextLengthError(f"the {prompt} ({prompt_tokens} tokens){added} exceeds the context of {limit} tokens",
                             errors={"prompt_tokens": prompt_tokens, "max_tokens": new_tokens, "max_context": limit})


def sampling_knob_problems(params: Mapping[str, Any]) -> dict[str, str]:
    """``{field: problem}`` for the sampling knobs that contradict each other (each knob's own
    range is its field's check): ``min_tokens`` past ``max_tokens``, stop strings without
    ``detokenize``. One rule for the API's schema, its defaults and the engine's SamplingParams."""
    problems = {}
    min_tokens, max_tokens = params.get("min_tokens", 0), params.get("max_tokens")
    if isinstance(min_tokens, int) and isinstance(max_tokens, int) and min_tokens > max_tokens:
        problems["min_tokens"] = f"must not exceed max_tokens ({max_tokens})"
    if params.get("stop") and params.get("detokenize") is False:
        problems["stop"] = "stop strings are matched on the detokenized text: they need detokenize"
    return problems


def check_metadata(metadata: Any, max_bytes: int) -> None:
    """A request's or a batch's ``metadata``: at most ``max_bytes`` as JSON."""
    if metadata is not None and len(json.dumps(metadata)) > max_bytes:
        raise InvalidRequestError("metadata is too large", errors={"metadata": [f"at most {max_bytes} bytes as JSON"]})
