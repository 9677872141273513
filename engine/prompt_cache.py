"""Recent prompts' KV and last logits, so a prompt group whose requests arrive apart still
computes its prompt once (a small LRU bounded in tokens).

A key is the request's cache scope (the API key in the service), the weight version, the prompt's
token ids and its media keys: the same ids with other images are another prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.kv_batch import PromptKV


@dataclass
class PrefilledPrompt:
    kv: PromptKV
    logits: torch.Tensor  # (vocab,) fp32 raw logits after the prompt's last token
    rope_delta: int | None  # M-RoPE models: position offset of the tokens after the prompt
    length: int


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
        if prompt.length > self.max_tokens or key in self._entries:
            return
        self._entries[key] = prompt
        self._tokens += prompt.length
        while self._tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= dropped.length

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)
