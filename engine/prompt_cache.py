"""A prefilled prompt, and the last logits of recent prompts: what a prompt found whole in the KV
pool needs besides its blocks to start decoding with no forward at all.

The blocks themselves are found by name in the pool (:mod:`engine.paged_kv`,
:mod:`engine.prefix_hash`): a prompt group whose samples arrive apart finds every block of its
prompt, the partial last one included, and its logits here under the name of that last block, which
holds the cache scope, the weights, the tokens and the media of the whole prompt. Where the logits
are gone (or a prompt extends a cached one), the scheduler computes only the tokens after the
cached blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.paged_kv import PagedPrompt


@dataclass
class PrefilledPrompt:
    kv: PagedPrompt
    logits: torch.Tensor  # (vocab,) fp32 raw logits after the prompt's last token
    rope_delta: int | None  # M-RoPE models: position offset of the tokens after the prompt
    length: int
    # Routed experts (engine/routing/) of the prompt's last positions, (n, layers, k): those its
    # forward computed when a request asked; None otherwise.
    routing: torch.Tensor | None = None

    @property
    def finite(self) -> bool:
        """Whether the forward stayed finite: a prompt whose logits are NaN or infinite is never
        kept for reuse (its rows fail alone in the sampler)."""
        return bool(torch.isfinite(self.logits).all())


@dataclass(frozen=True)
class PromptEnd:
    logits: torch.Tensor
    rope_delta: int | None
    length: int


@dataclass
class PromptEnds:
    """Recent prompts' last logits by the name of their last block: an LRU bounded by the prompt
    tokens its entries stand for (``prompt_cache_tokens``; 0 keeps none)."""

    max_tokens: int
    _entries: OrderedDict[bytes, PromptEnd] = field(default_factory=OrderedDict, repr=False)
    _tokens: int = 0

    def get(self, name: bytes) -> PromptEnd | None:
        entry = self._entries.get(name)
        if entry is not None:
            self._entries.move_to_end(name)
        return entry

    def put(self, name: bytes, prompt: PrefilledPrompt) -> None:
        if prompt.length > self.max_tokens or name in self._entries:
            return
        self._entries[name] = PromptEnd(prompt.logits, prompt.rope_delta, prompt.length)
        self._tokens += prompt.length
        while self._tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= dropped.length

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)
