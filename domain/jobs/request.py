"""One job's request, typed: what every layer below the web takes.

The web layer validates a body once (``web/api/schemas.py``, then the service's limits in
``web/api/submit.py``) into a plain dict in our field names; every dialect maps into that dict.
:meth:`JobRequest.from_dict` turns it into this object at the edge, mapping API meaning to
engine meaning there and only there (``top_k: -1`` means off: the engine's 0). The job record
stores the validated dict as JSON (``to_record``); a worker reads it back with the
same constructor, the same mapping, so a record stored by an older build (before a
sampling knob existed) still reads, with that knob's default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams

# Stored-request keys that become SamplingParams fields as they are (the rest are mapped below).
_SAMPLING_KNOBS = ("stop", "include_stop_str_in_output", "min_tokens", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "top_logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens",
                   "spaces_between_special_tokens", "max_policy_lag", "logprobs_mode", "sampling_mask",
                   "structured_output", "routed_experts")


@dataclass(frozen=True)
class JobRequest:
    kind: str  # "generate" | "score"
    sampling: SamplingParams
    token_ids: list[int] | None = None
    prompt: str | None = None
    content_parts: list[dict[str, Any]] = field(default_factory=list)
    features: list[dict[str, Any]] | None = None
    completion_token_ids: list[int] | None = None  # kind "score": the tokens to score
    request_id: str | None = None
    cache_salt: str | None = None  # KV reuse only among requests of the same key and salt
    session_id: str | None = None  # an agent's turns (X-Session-ID): kept on one GPU worker
    webhook: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # The validated dict this was built from, as the job record stores it.
    record: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> JobRequest:
        """From a validated request: the web layer's (``sampling_params`` complete, defaults
        filled), a job record's ``request`` or a batch's stored line. Raises InvalidRequestError
        (422) for sampling values the engine refuses, so the API stores no such job."""
        return cls(
            kind=record.get("kind", "generate"),
            # A score line may come without any: scoring samples nothing.
            sampling=sampling_params(record["sampling_params"]) if "sampling_params" in record else SamplingParams(),
            token_ids=record.get("token_ids"), prompt=record.get("prompt"),
            content_parts=record.get("content_parts") or [], features=record.get("features"),
            completion_token_ids=record.get("completion_token_ids"), request_id=record.get("request_id"),
            cache_salt=record.get("cache_salt"), session_id=record.get("session_id"), webhook=record.get("webhook"), metadata=record.get("metadata"), record=record,
        )

    def to_record(self) -> dict[str, Any]:
        return self.record

    def cache_scope(self, owner: str) -> str:
        """Whose KV blocks this request may reuse (``engine.prefix_hash``): its key's, and among
        them only those of requests with the same ``cache_salt`` (vLLM's and SGLang's meaning)."""
        return owner if self.cache_salt is None else f"{owner}\x1fsalt:{self.cache_salt}"

    @property
    def has_media(self) -> bool:
        return bool(self.content_parts or self.features)

    def processor_input(self) -> dict[str, Any]:
        """What ``processors.pipeline.preprocess`` takes: the prompt and its media."""
        fields = {"token_ids": self.token_ids, "prompt": self.prompt, "content_parts": self.content_parts,
                  "features": self.features}
        return {name: value for name, value in fields.items() if value is not None}


def sampling_params(params: dict[str, Any]) -> SamplingParams:
    """The engine's SamplingParams from a stored request's ``sampling_params`` (API names and
    meanings): every key the API accepts has a field."""
    return SamplingParams(
        max_tokens=params["max_tokens"], temperature=params["temperature"], top_p=params["top_p"],
        top_k=max(params["top_k"], 0), min_p=params["min_p"], n=params["n"], seed=params.get("seed"),
        stop_token_ids=tuple(params.get("stop_token_ids") or ()), ignore_eos=params["ignore_eos"],
        logprobs=params["logprobs"],
        **{name: params[name] for name in _SAMPLING_KNOBS if name in params},
    )
