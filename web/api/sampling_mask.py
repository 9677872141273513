"""The size guard of ``sampling_params.sampling_mask``: a mask lists, per output token, every id
the token could have been drawn from. Without truncation that is the whole vocabulary (152k ids a
token on Qwen: megabytes of JSON per choice in the result, the stored record and every stream), and
it says nothing the trainer does not know already (its full-vocabulary softmax is that
distribution). So a mask is served only where something bounds it: greedy, ``top_k`` of at most
``MAX_SAMPLING_MASK_IDS``, ``top_p`` < 1 or ``min_p`` > 0 (the nucleus, which SGLang also admits
alone), or a vocabulary no larger than the cap. vLLM refuses more (it needs ``top_k`` > 0).
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import GREEDY_BELOW_TEMPERATURE

# A top_k above this does not bound a mask (a reply of tokens x 4096 ids is already ~20 KB a token).
MAX_SAMPLING_MASK_IDS = 4096


class SamplingMaskUnboundedError(InvalidRequestError):
    """A sampling mask asked for without the truncation that bounds its size."""

    code = "sampling_mask_unbounded"


def check_sampling_mask(params: dict[str, Any], vocab_size: int | None) -> None:
    """Raise :class:`SamplingMaskUnboundedError` (422) for a mask request nothing bounds."""
    if not params.get("sampling_mask"):
        return
    top_k = params.get("top_k", -1)
    if (params.get("temperature", 1.0) < GREEDY_BELOW_TEMPERATURE or 0 < top_k <= MAX_SAMPLING_MASK_IDS
            or params.get("top_p", 1.0) < 1 or params.get("min_p", 0.0) > 0
            or (vocab_size is not None and vocab_size <= MAX_SAMPLING_MASK_IDS)):
        return
    raise SamplingMaskUnboundedError(
        f"a sampling mask needs truncation: top_k from 1 to {MAX_SAMPLING_MASK_IDS}, top_p < 1 or min_p > 0 "
        f"(without it every token's mask is the whole vocabulary, {vocab_size} ids)",
        errors={"field": "sampling_params.sampling_mask", "vocab_size": vocab_size,
                "max_top_k": MAX_SAMPLING_MASK_IDS})
