"""What a finished request returns: its choices from its rows' decoders, usage, timings, the
weight version that made it, and its prompt logprobs when asked (the runner's teacher-forced
forward: :meth:`engine.step_runner.StepRunner.prompt_logprobs`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine.batch_inputs import placeholder_ranges
from engine.choice import Choice
from engine.generation_types import GenerationResult
from engine.model_facts import ModelFacts
from engine.routing.result import choice_routing


def build_result(facts: ModelFacts, job: Any,
                 prompt_logprobs: Callable[[Any, dict], dict[str, Any]]) -> GenerationResult:
    """``job``: the scheduler's (``request``, ``rows``, ``features``, timing marks, ``cached_tokens``);
    ``prompt_logprobs(request, features)`` scores its prompt when it asked."""
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
        scored = {**prompt_logprobs(request, job.features), "prompt_logprobs_version": facts.weight_version}
        timings["prompt_logprobs_s"] = time.perf_counter() - started
    choices = [Choice(index=row.choice_index, token_ids=list(row.token_ids), logprobs=row.logprobs(),
                      finish_reason=row.finish_reason, matched_stop=row.matched_stop, text=row.text(),
                      top_logprobs=row.top_logprobs(), sampling_mask=row.packed_sampling_mask(),
                      weight_versions=row.versions.spans(len(row.token_ids)),
                      kv_recomputed=row.versions.kv_recomputed(),
                      routed_experts=choice_routing(row, len(request.prompt_token_ids)))
               for row in job.rows]
    # The version at the end: the last span of the choice with the most (the rows of a request
    # start on one version); a request with no token, the weights serving now.
    spans = max((c.weight_versions for c in choices), key=len, default=None)
    version = spans[-1]["version"] if spans else facts.weight_version
    return GenerationResult(
        prompt_token_ids=list(request.prompt_token_ids),
        choices=choices,
        usage={"prompt_tokens": len(request.prompt_token_ids),
               "completion_tokens": sum(len(c.token_ids) for c in choices)},
        timings=timings,
        weight_version=version,
        placeholder_ranges=placeholder_ranges(facts, request.prompt_token_ids, request.items),
        cached_tokens=job.cached_tokens,
        **scored,
    )

