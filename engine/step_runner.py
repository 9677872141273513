"""The seam between the scheduler's policy and the forwards it decides on (vLLM V1's cut between
its ``Scheduler`` and ``GPUModelRunner``): :class:`StepRunner` is everything the policy asks of a
model, :class:`PromptInput` what it hands over for a prefill. :class:`engine.model_runner.ModelRunner`
runs them on a transformers model; the policy itself never touches one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.encoder_cache import MediaUnit
from engine.paged_kv import BlockPool
from engine.prompt_cache import PrefilledPrompt
from engine.running_batch import RunningBatch


@dataclass
class PromptInput:
    """One prompt to prefill: its ids and media, and the cached blocks it starts after (``prefix``,
    one reference each, which the prefilled prompt takes over) holding its first ``start`` tokens."""

    token_ids: Sequence[int]
    features: dict[str, torch.Tensor]
    units: Sequence[MediaUnit]
    prefix: list[int] = field(default_factory=list)
    start: int = 0
    adapter: str = ""  # the LoRA adapter it runs under (engine/lora/); "" is the base
    routed: bool = False  # a request of it asked for its routed experts (engine/routing/)


class StepRunner(Protocol):
    """Runs a step's forwards. Every prompt it prefills has its K/V written into ``pool``'s blocks
    (after the prompt's ``prefix``, whose references the returned prompt takes over, or which go
    back to the pool if the call raises)."""

    pool: BlockPool

    @property
    def attn_implementation(self) -> str | None: ...

    def decode(self, batch: RunningBatch) -> torch.Tensor:
        """One decode forward over the running rows: raw fp32 logits, (rows, vocab)."""

    def prefill(self, prompts: Sequence[PromptInput]) -> list[PrefilledPrompt]:
        """One forward over ``prompts``, each from the end of its cached blocks."""

    def start_chunked(self, prompt: PromptInput) -> Any:
        """A long prompt to prefill a chunk per step: state that :meth:`prefill_chunk` advances."""

    def prefill_chunk(self, state: Any, chunk_tokens: int) -> PrefilledPrompt | None:
        """The next chunk; the prefilled prompt once the last one ran, else None."""

    def drop_chunked(self, state: Any) -> None:
        """A chunked prefill given up: its prefix goes back to the pool."""

    def prompt_routing(self, token_ids: Sequence[int], features: dict[str, torch.Tensor],
                       adapter: str = "") -> torch.Tensor:
        """A whole prompt's routed experts, (len, layers, k), by a forward of its own."""

    def prompt_logprobs(self, request: Any, features: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``{prompt_logprobs, prompt_top_logprobs}`` of a finished request that asked for them."""
