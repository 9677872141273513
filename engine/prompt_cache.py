"""Recent prompts' KV and last logits, so a prompt group whose requests arrive apart still
computes its prompt once (a small LRU bounded in tokens).

An entry holds a reference to the prompt's blocks in the KV pool (:mod:`engine.paged_kv`), not a
copy: rows that join from it share them. The pool takes entries back, oldest first, when it runs
short (:meth:`PromptCache.evict_oldest` is its ``reclaim``).

A key is the request's cache scope (the API key in the service), the weight version, the prompt's
token ids and its media keys: the same ids with other images are another prompt.
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

    @property
    def finite(self) -> bool:
        """Whether the forward stayed finite: a prompt whose logits are NaN or infinite is never
        kept for reuse (its rows fail alone in the sampler)."""
        return bool(torch.isfinite(self.logits).all())


@dataclass
class PromptCache:
    max_tokens: int
    _entries: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _tokens: int = 0

    def get(self, key) -> PrefilledPrompt | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key, prompt: PrefilledPrompt) -> None:
        """Keep ``prompt`` (a reference of its own to its blocks), evicting the oldest past the bound."""
        if prompt.length > self.max_tokens or key in self._entries or not prompt.finite:
            return
        self._entries[key] = PrefilledPrompt(prompt.kv.hold(), prompt.logits, prompt.rope_delta, prompt.length)
        self._tokens += prompt.length
        while self._tokens > self.max_tokens:
            self.evict_oldest()

    def evict_oldest(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        if not self._entries:
            return False
        _, dropped = self._entries.popitem(last=False)
        self._tokens -= dropped.length
        dropped.kv.release()
        return True

    def clear(self) -> None:
        while self.evict_oldest():
            pass

    def __len__(self) -> int:
        return len(self._entries)
