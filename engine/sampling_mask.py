"""One row's sampling masks (``SamplingParams.sampling_mask``), kept compactly a step at a time and
returned as vLLM's SamplingMask: CSR over the output tokens.

Each step's mask is the ids of its support, ascending (engine/processed_rows.py), as an int32
array on the host: a step without truncation keeps the whole vocabulary, and an array holds it in
4 bytes an id where a list of ints takes 8 for the pointer alone.
"""

from __future__ import annotations

import numpy as np


class SamplingMasks:
    """The masks of one row's tokens, in order: one :meth:`add` per token it records."""

    def __init__(self) -> None:
        self._steps: list[np.ndarray] = []

    def add(self, token_ids: np.ndarray) -> None:
        self._steps.append(token_ids)

    def csr(self) -> dict[str, list[int]]:
        """``{"token_ids": [...], "offsets": [...]}``: token i's support is
        ``token_ids[offsets[i]:offsets[i + 1]]``; ``offsets`` has one entry more than the tokens."""
        offsets = np.zeros(len(self._steps) + 1, dtype=np.int64)
        np.cumsum([len(step) for step in self._steps], out=offsets[1:])
        token_ids = np.concatenate(self._steps) if self._steps else np.zeros(0, dtype=np.int32)
        return {"token_ids": token_ids.tolist(), "offsets": offsets.tolist()}
