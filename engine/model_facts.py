"""What the scheduler's policy reads of a model: its ids, limits, weight version and where its
tensors live, never its weights. :class:`engine.loading.LoadedModel` is one; a test of the policy
alone describes a model by these facts and nothing else (tests/engine/test_scheduler_policy.py)."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ModelFacts(Protocol):
    weight_version: str  # changes with every weight swap: read it, never copy it
    eos_token_ids: tuple[int, ...]
    context_tokens: int | None  # the context a prompt and its new tokens must fit: Limits.context_tokens
    media_token_ids: dict[str, int]  # modality -> placeholder token id
    tokenizer: Any  # detokenizes and matches stop strings; None: results carry no text
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int: ...
