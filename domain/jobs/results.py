"""The result a job ends with, for generation and scoring alike: one builder (``engine_result``),
used by the GPU session's jobs (``workers/gpu/jobs.py``) and by batch lines scored without a job
(``workers/tasks/score_lines.py``), and one typed reading of it (``JobResult``), which every
protocol adapter maps from.

The stored result is a dict because it is the public ``result`` of ``GET /v1/jobs/{id}``, but for
its choices' sampling masks: stored packed (``engine/sampling_mask.py``), read as the CSR lists
(:func:`readable_result`, as the job store decodes a record; ``web/api/stored_json.py`` for a result
sent from its stored bytes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.choice import Choice
from engine.sampling_mask import is_packed, unpack


def engine_result(output, *, kind: str, prompt_token_ids: list[int], placeholder_ranges: list[dict],
                  weight_version: str, transport: str, timings: dict[str, float],
                  nodes: dict[str, str] | None = None) -> dict[str, Any]:
    """The stored ``result`` of an engine ``output``: a ``ScoreResult`` for ``kind`` score (scored
    by ``weight_version``, the weights serving as it ran), else a ``GenerationResult``. ``nodes``: where the prompt was preprocessed and where it ran (the node, and the GPU worker)."""
    result: dict[str, Any] = {"prompt_token_ids": prompt_token_ids, "placeholder_ranges": placeholder_ranges,
                              "weight_version": weight_version, "timings": timings, "transport": transport}
    if nodes is not None:
        result["nodes"] = nodes
    if kind == "score":
        result.update(completion_logprobs=output.logprobs, usage=output.usage)
        if output.routed_experts is not None:  # every scored position's, packed (engine/routing/)
            result["routed_experts"] = output.routed_experts
        return result
    # weight_version: the weights of its last token (a row continued across an update, mode keep,
    # has several: each choice's weight_versions spans name them).
    result.update(choices=[asdict(choice) for choice in output.choices], usage=output.usage,
                  cached_tokens=output.cached_tokens, weight_version=output.weight_version or weight_version)
    if output.prompt_logprobs is not None:
        result.update(prompt_logprobs=output.prompt_logprobs, prompt_top_logprobs=output.prompt_top_logprobs,
                      prompt_logprobs_version=output.prompt_logprobs_version or weight_version)
    return result


def readable_result(result: Any) -> Any:
    """``result`` as every reply shows it: each choice's packed sampling mask as its CSR lists."""
    choices = result.get("choices") if isinstance(result, dict) else None
    if not choices or not any(is_packed(choice.get("sampling_mask")) for choice in choices):
        return result
    return {**result, "choices": [{**choice, "sampling_mask": unpack(choice.get("sampling_mask"))}
                                  for choice in choices]}


@dataclass(frozen=True)
class JobResult:
    """A job's stored result as adapters read it. A job that ended before it ran (cancelled while
    queued, failed) stored none: it reads as ``n`` empty aborted choices and zero usage."""

    prompt_token_ids: list[int]
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None
    cached_tokens: int
    # Per prompt token, given the tokens before it (None for the first), when asked.
    prompt_logprobs: list[float | None] | None
    prompt_top_logprobs: list[list[list] | None] | None
    # [{modality, offset, length}]: each media item's placeholder run in prompt_token_ids.
    placeholder_ranges: list[dict] = ()

    @classmethod
    def of(cls, job: dict[str, Any], *, n: int = 1) -> JobResult:
        stored = job.get("result") or {}
        usage = stored.get("usage") or {}
        choices = [Choice.from_record(c) for c in stored.get("choices") or []]
        return cls(prompt_token_ids=stored.get("prompt_token_ids") or [],
                   choices=choices or [Choice.aborted(i) for i in range(n)],
                   prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=usage.get("completion_tokens", 0),
                   weight_version=stored.get("weight_version"), cached_tokens=stored.get("cached_tokens") or 0,
                   prompt_logprobs=stored.get("prompt_logprobs"), prompt_top_logprobs=stored.get("prompt_top_logprobs"),
                   placeholder_ranges=stored.get("placeholder_ranges") or [])

    def choice(self, index: int) -> Choice | None:
        return next((c for c in self.choices if c.index == index), None)
