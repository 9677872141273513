"""Checks a validated request against the service's limits, then submits it."""

from __future__ import annotations

import json
from typing import Any

from engine.capacity import check_capacity
from engine.errors import ContextLengthError, InvalidRequestError, check_token_ids
from web.auth import current_owner
from web.services import services
from workers.gpu_limits import scheduler_limits
from workers.job_request import JobRequest
from workers.submission import submit_job


class TooManyContentPartsError(InvalidRequestError):
    code = "too_many_content_parts"


def check_limits(request: dict[str, Any]) -> dict[str, Any]:
    """Apply the configured limits and fill defaults; returns the request as it will be stored."""
    svc = services()
    settings = svc.settings
    parts = request.get("content_parts") or []
    if len(parts) > settings.max_content_parts:
        raise TooManyContentPartsError(
            f"{len(parts)} content parts; at most {settings.max_content_parts} are accepted"
        )
    metadata = request.get("metadata")
    if metadata is not None and len(json.dumps(metadata)) > settings.max_metadata_bytes:
        raise InvalidRequestError("metadata is too large",
                                  errors={"metadata": [f"at most {settings.max_metadata_bytes} bytes as JSON"]})
    params = request["sampling_params"]
    check_vocabulary(request, svc.model_facts.vocab_size)
    params.setdefault("max_tokens", settings.default_max_tokens)
    if params.get("min_tokens", 0) > params["max_tokens"]:
        raise InvalidRequestError("min_tokens exceeds max_tokens",
                                  errors={"sampling_params": {"min_tokens": [f"at most max_tokens ({params['max_tokens']})"]}})
    max_len = svc.max_model_len
    prompt_len = len(request.get("token_ids") or [])
    wanted = prompt_len + (len(request.get("completion_token_ids") or []) or params["max_tokens"])
    if max_len and wanted > max_len:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) plus completion ({wanted - prompt_len}) exceeds the model's "
            f"context of {max_len} tokens"
        )
    if request.get("kind", "generate") == "generate":
        # Image placeholders are expanded later; a prompt that can never fit is refused now.
        check_capacity(scheduler_limits(settings), prompt_len, params["max_tokens"], params.get("n", 1))
    return request


def check_vocabulary(request: dict[str, Any], vocab_size: int | None) -> None:
    """Every token id the user sent must be one the model has (TokenIdOutOfRangeError, 422, names
    the field and index), so a bad id never reaches a GPU batch shared with other keys' jobs. The
    engine checks again (engine.batch_inputs), for jobs that come by other ways."""
    if vocab_size is None:  # a config without vocab_size: the engine's check alone holds
        return
    for field, token_ids in (("token_ids", request.get("token_ids")),
                             ("completion_token_ids", request.get("completion_token_ids")),
                             ("sampling_params.stop_token_ids", request["sampling_params"].get("stop_token_ids"))):
        if token_ids:
            check_token_ids(token_ids, vocab_size, field)


def submit(request: dict[str, Any]) -> dict[str, Any]:
    """Check the validated ``request`` against the limits, type it, store and enqueue its job."""
    svc = services()
    return submit_job(svc.jobs, svc.celery, owner=current_owner(), request=JobRequest.from_dict(check_limits(request)),
                      model=svc.model_facts)
