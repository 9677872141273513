"""The most bytes a job's stored result can take, known before it runs: from ``n``, ``max_tokens``,
``top_logprobs``, prompt logprobs (over the prompt's length), the sampling mask (``n`` ×
``max_tokens`` × the ids its truncation lets through), routed experts (every position × the
model's MoE layers × top-k, packed: engine/routing/) and what else a result stores per token (its
text, its ``weight_versions`` spans). The API refuses a job whose bound passes the limit
(``ROLLOUT_MAX_RESULT_BYTES``: 422 ``result_too_large``), and reserves the bound against Redis'
headroom while the job runs (``domain/infra/redis_reservations.py``).

Model-free and torch-free: counted from the request and the vocabulary's size. Each figure is JSON
as the result is stored (``domain/infra/finite_json.compact``, orjson); ``tests/engine/test_result_bound.py``
checks it against real results of the demo model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_mask import packed_bytes
from engine.sampling_params import GREEDY_BELOW_TEMPERATURE

# A float as orjson writes it at the longest ("-1.2345678901234567e-308", or null), with its comma.
FLOAT_BYTES = 25
# A token's text: an allowance, not a strict bound (no model-free one exists: the longest token of
# a 152k vocabulary decodes to 256 bytes, the average to about 4). A row of only the longest tokens
# overruns it; the high-water mark's margin takes that (domain/infra/redis_memory.py).
TEXT_BYTES_PER_TOKEN = 48
# ``weight_versions``: a span per weight update the row crossed, at most one a decode step; counted
# up to this many a choice (each update loads a whole model: more within one row is no rollout).
SPANS_PER_CHOICE = 64
VERSION_BYTES = 128  # a weight version's longest name (web/api/weights.py)
# The rest of a record: usage, timings, nodes, the transport, the version, the keys of each choice.
FIXED_BYTES = 2048
CHOICE_FIXED_BYTES = 512
PLACEHOLDER_RANGE_BYTES = 64  # {"modality":..,"offset":..,"length":..} per media item


class ResultTooLargeError(InvalidRequestError):
    """A job whose result could pass ``ROLLOUT_MAX_RESULT_BYTES``."""

    code = "result_too_large"


def result_bytes_bound(params: Mapping[str, Any], *, kind: str = "generate", prompt_tokens: int,
                       completion_tokens: int = 0, media_items: int = 0, vocab_size: int | None,
                       routed_bytes_per_token: int = 0) -> int:
    """The most bytes the stored result of a request can take. ``params``: its ``sampling_params``
    as the API validated them (API names, defaults filled); ``prompt_tokens``: its prompt's length
    (an upper bound where media or text are still to be tokenized); ``completion_tokens``: a score
    job's completion; ``routed_bytes_per_token``: one position's packed routed experts
    (engine/routing/shape.py; 0 for a model without experts)."""
    int_bytes = _digits(vocab_size - 1 if vocab_size else 2**32) + 1
    total = FIXED_BYTES + prompt_tokens * int_bytes + media_items * PLACEHOLDER_RANGE_BYTES
    routed = routed_bytes_per_token if params.get("routed_experts") else 0
    if kind == "score":
        return total + completion_tokens * FLOAT_BYTES + _routed_bytes(routed, prompt_tokens + completion_tokens)
    tokens = params["max_tokens"]
    top = params.get("top_logprobs") or 0
    per_token = int_bytes + TEXT_BYTES_PER_TOKEN + FLOAT_BYTES  # the id, its text, its logprob
    per_token += 3 + top * _entry_bytes(int_bytes) if top else 0  # [[id,logprob],...] per token
    spans = min(tokens, SPANS_PER_CHOICE) * (40 + VERSION_BYTES + 2 * _digits(tokens))
    per_choice = (CHOICE_FIXED_BYTES + tokens * per_token + spans + _mask_bytes(params, tokens, vocab_size)
                  + _routed_bytes(routed, prompt_tokens + tokens))
    total += params.get("n", 1) * per_choice
    if params.get("prompt_logprobs") is not None:  # a logprob and its top-k per prompt token
        total += prompt_tokens * (FLOAT_BYTES + 3 + params["prompt_logprobs"] * _entry_bytes(int_bytes))
    return total


def check_result_size(bound: int, limit: int) -> None:
    """422 ``result_too_large`` when a job's :func:`result_bytes_bound` passes ``limit``."""
    if bound > limit:
        raise ResultTooLargeError(
            f"this job's result could take {bound} bytes, past ROLLOUT_MAX_RESULT_BYTES ({limit}): ask for fewer "
            "tokens, choices (n), top_logprobs or prompt_logprobs, or bound the sampling mask with top_k",
            errors={"result_bytes": bound, "max_result_bytes": limit, "setting": "ROLLOUT_MAX_RESULT_BYTES"})


def mask_support_bound(params: Mapping[str, Any], vocab_size: int | None) -> int:
    """The most ids one token's mask can list: one when greedy, ``top_k`` when set, else the whole
    vocabulary (``top_p`` and ``min_p`` bound nothing in the worst case: a flat distribution)."""
    full = vocab_size or 2**32
    if params.get("temperature", 1.0) < GREEDY_BELOW_TEMPERATURE:
        return 1
    top_k = params.get("top_k", -1)
    return min(top_k, full) if top_k > 0 else full


def _mask_bytes(params: Mapping[str, Any], tokens: int, vocab_size: int | None) -> int:
    """A choice's packed mask (engine/sampling_mask.py): its ids and its offsets, each at their width."""
    if not params.get("sampling_mask"):
        return 0
    width = 2 if vocab_size is not None and vocab_size <= 1 << 16 else 4
    ids = tokens * mask_support_bound(params, vocab_size)
    return 64 + packed_bytes(ids * width) + packed_bytes((tokens + 1) * width)


def _routed_bytes(per_token: int, positions: int) -> int:
    """A choice's packed routed experts: base64 of ``positions`` × ``per_token`` bytes, and its keys."""
    return 96 + packed_bytes(positions * per_token) if per_token else 0


def _entry_bytes(int_bytes: int) -> int:
    return 3 + int_bytes + FLOAT_BYTES  # [id,logprob], with its comma


def _digits(value: int) -> int:
    return len(str(max(value, 0)))


def request_result_bound(request: Mapping[str, Any], *, context_tokens: int | None, vocab_size: int | None,
                         routed_bytes_per_token: int = 0) -> int:
    """:func:`result_bytes_bound` of a validated request (the API's dict: ``sampling_params`` with
    ``max_tokens`` filled). Its prompt's length where it is not known yet: a text prompt at most a
    token per UTF-8 byte (byte-level vocabularies) plus a template's few, media at most the context
    left beside ``max_tokens``."""
    params = request.get("sampling_params") or {"max_tokens": 0}
    kind = request.get("kind", "generate")
    completion = len(request.get("completion_token_ids") or ())
    new_tokens = completion if kind == "score" else params["max_tokens"]
    room = None if context_tokens is None else max(context_tokens - new_tokens, 0)
    media = len(request.get("content_parts") or ()) + len(request.get("features") or ())
    if request.get("token_ids") is not None and not media:
        prompt = len(request["token_ids"])
    elif request.get("token_ids") is None and not media:
        prompt = len((request.get("prompt") or "").encode()) + 64
        prompt = prompt if room is None else min(prompt, room)
    else:
        prompt = room if room is not None else len(request.get("token_ids") or ()) + 64
    return result_bytes_bound(params, kind=kind, prompt_tokens=prompt, completion_tokens=completion,
                              media_items=media, vocab_size=vocab_size, routed_bytes_per_token=routed_bytes_per_token)
