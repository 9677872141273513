"""What a finished request returns: its choices from its rows' decoders, usage, timings, the
weight version that made it, and its prompt logprobs when asked (teacher-forced: the model's own
forward over the prompt, as scoring computes it)."""

from __future__ import annotations

import time
from typing import Any

from engine.batch_inputs import Row, placeholder_ranges
from engine.choice import Choice
from engine.generation_types import GenerationResult
from engine.loading import LoadedModel
from engine.scoring import teacher_forced


def build_result(loaded: LoadedModel, job: Any) -> GenerationResult:
    """``job``: the scheduler's (``request``, ``rows``, ``features``, timing marks, ``cached_tokens``)."""
    request = job.request
    now = time.perf_counter()
    timings: dict[str, float] = {}
    if job.admitted_at is not None:
        first = job.first_token_at or now
        timings = {"prefill_s": first - job.admitted_at, "decode_s": now - first}
    if request.enqueued_at is not None:
        timings["queue_s"] = max(0.0, (job.admitted_wall or time.time()) - request.enqueued_at)
    scored = {}
    if request.sampling.prompt_logprobs is not None and job.admitted_at is not None:  # it ran
        started = time.perf_counter()
        scored = prompt_logprobs(loaded, request, job.features)
        timings["prompt_logprobs_s"] = time.perf_counter() - started
    choices = [Choice(index=row.choice_index, token_ids=list(row.token_ids), logprobs=row.logprobs(),
                      finish_reason=row.finish_reason, matched_stop=row.matched_stop, text=row.text(),
                      top_logprobs=row.top_logprobs())
               for row in job.rows]
    return GenerationResult(
        prompt_token_ids=list(request.prompt_token_ids),
        choices=choices,
        usage={"prompt_tokens": len(request.prompt_token_ids),
               "completion_tokens": sum(len(c.token_ids) for c in choices)},
        timings=timings,
        weight_version=loaded.weight_version,
        placeholder_ranges=placeholder_ranges(loaded, request.prompt_token_ids, request.items),
        cached_tokens=job.cached_tokens,
        **scored,
    )


def prompt_logprobs(loaded: LoadedModel, request, features) -> dict[str, Any]:
    """``{prompt_logprobs, prompt_top_logprobs}`` of one request by teacher-forced scoring."""
    length, k = len(request.prompt_token_ids), request.sampling.prompt_logprobs
    entry: dict[str, Any] = {"prompt_logprobs": [None]}  # the first prompt token has no logprob
    if k:
        entry["prompt_top_logprobs"] = [None]
    if length == 1:  # nothing to score: no forward
        return entry
    [(logprobs, top)] = teacher_forced(loaded, [Row(request.prompt_token_ids, features)], [length - 1], top_k=k)
    entry["prompt_logprobs"] += logprobs[-(length - 1):]
    if k:
        entry["prompt_top_logprobs"] += [step[:k] for step in top[-(length - 1):]]
    return entry
