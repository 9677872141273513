"""References for rows that cross a weight update, computed with transformers directly: the
logprob of each token under the forward of the weights that made it (tests of update mode keep:
tests/engine/test_keep_across_update.py, tests/workers/gpu/test_update_modes_session.py)."""

from __future__ import annotations

import torch


def _logprobs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    rows = torch.log_softmax(logits.float(), dim=-1)
    return [rows[i, t].item() for i, t in enumerate(tokens)]


@torch.no_grad()
def teacher_forced(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each token's logprob under ``model``'s forward over the whole sequence before it."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
    return _logprobs(logits[len(prompt) - 1:-1], tokens)


@torch.no_grad()
def old_kv_then_new(old, new, prompt: list[int], tokens: list[int], at: int) -> list[float]:
    """Tokens ``at``.. under the new model's forward of the tokens after the cache, attending to
    the cache the old model computed over the prompt and the first ``at - 1`` tokens (the row
    feeds token ``at - 1`` in the first step after the swap)."""
    held = prompt + tokens[:at - 1]
    out = old(input_ids=torch.tensor([held]), position_ids=torch.arange(len(held))[None], use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    rest = tokens[at - 1:-1]
    positions = torch.arange(len(held), len(held) + len(rest))[None]
    logits = new(input_ids=torch.tensor([rest]), position_ids=positions, cache=cache).logits[0]
    return _logprobs(logits, tokens[at:])
