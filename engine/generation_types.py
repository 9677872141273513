"""What a generation call takes and gives: one request, its result (its choices: ``engine/choice.py``).

Apart from :mod:`engine.generation` so the scheduler, which builds results, and the engine, which
drives the scheduler, both import them without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.choice import Choice
from engine.items import MultimodalItem
from engine.sampling_params import SamplingParams


@dataclass
class GenerationRequest:
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    items: Sequence[MultimodalItem] = ()  # finalized items with real tensors, or
    mm_kwargs: Mapping[str, torch.Tensor] | None = None  # ready model kwargs (pixel_values, ...)
    enqueued_at: float | None = None  # time.time() when the job was queued, for timings
    # Requests share KV blocks only within one scope: the service passes the API key (and the
    # request's cache_salt), so cached_tokens never tells one key what another sent.
    cache_scope: str = ""
    # Whose share of the running batch this request takes (the API key): admission serves the
    # tenant holding the fewest rows first (engine.capacity.next_admission).
    tenant: str = ""
    # The LoRA adapter (its id in the engine's bank, engine/lora/) the request runs under; "" is the
    # base. Its KV blocks are named under it: a prefix is reused only under the same adapter.
    adapter: str = ""


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    choices: list[Choice]
    usage: dict[str, int]
    timings: dict[str, float]
    weight_version: str  # the weights of its last token (each choice's weight_versions has them all)
    placeholder_ranges: list[dict[str, Any]] = field(default_factory=list)
    # With sampling.prompt_logprobs: per prompt token, its logprob given the tokens before it
    # (None for the first), and the top k alternatives ([[token_id, logprob], ...]) when k > 0.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[list] | None] | None = None
    # The weights whose teacher-forced forward gave prompt_logprobs (those serving when the request
    # ended); None without them.
    prompt_logprobs_version: str | None = None
    # Prompt tokens not computed for this request: their KV blocks came from another request's
    # prefill or decoding (same key and salt, tokens, media, weights): SGLang's meta_info.cached_tokens.
    cached_tokens: int = 0
