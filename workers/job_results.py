"""The result a job ends with, for generation and scoring alike: one builder, used by the GPU
session's jobs (``workers/gpu_jobs.py``) and by batch lines scored without a job
(``workers/tasks/score_lines.py``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any


def engine_result(output, *, kind: str, prompt_token_ids: list[int], placeholder_ranges: list[dict],
                  weight_version: str, transport: str, timings: dict[str, float],
                  nodes: dict[str, str] | None = None) -> dict[str, Any]:
    """The stored ``result`` of an engine ``output``: a ``ScoreResult`` for ``kind`` score, else a
    ``GenerationResult``. ``nodes``: where the prompt was preprocessed and where it ran."""
    result: dict[str, Any] = {"prompt_token_ids": prompt_token_ids, "placeholder_ranges": placeholder_ranges,
                              "weight_version": weight_version, "timings": timings, "transport": transport}
    if nodes is not None:
        result["nodes"] = nodes
    if kind == "score":
        result.update(completion_logprobs=output.logprobs, usage=output.usage)
        return result
    result.update(choices=[asdict(choice) for choice in output.choices], usage=output.usage,
                  cached_tokens=output.cached_tokens)
    if output.prompt_logprobs is not None:
        result.update(prompt_logprobs=output.prompt_logprobs, prompt_top_logprobs=output.prompt_top_logprobs)
    return result
