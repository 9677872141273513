"""The routing of the engine's forwards, sliced per row and prompt (engine/model_runner.py calls
these around each forward it runs). A forward is recorded only when a row or prompt in it asked
(``SamplingParams.routed_experts``): otherwise the hooks return at their first check."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch

from engine.routing.capture import RouterCapture


def recording(capture: RouterCapture | None, wanted: Sequence[bool]):
    """The context a forward runs in: recording iff the model routes and something asked."""
    if capture is None or not any(wanted):
        return nullcontext()
    return capture.recording(True)


def after_decode(capture: RouterCapture | None, batch) -> None:
    """After a decode forward over ``batch`` (an engine.running_batch.RunningBatch, before it
    advances): each asking row's ids, at the position its fed token holds (its length)."""
    if capture is None or not any(row.routing is not None for row in batch.rows):
        return
    # (rows, layers, k): one token per row, copied to the host as it is (the sampler's copy back
    # waits on it; no sync here), where each row's view of it costs no device op.
    step = capture.take().to("cpu", non_blocking=True).numpy()
    for i, (row, length) in enumerate(zip(batch.rows, batch.lengths, strict=True)):
        if row.routing is not None:
            row.routing.add_step(length, step, i)


def after_prefill(capture: RouterCapture | None, prompts: Sequence, width: int) -> list[torch.Tensor | None]:
    """After a padded prefill of ``prompts`` (engine.step_runner.PromptInput; ``width`` columns,
    each prompt's computed part right-aligned): each asking prompt's ids for the positions the
    forward computed (``start`` to its end), None for the others."""
    if capture is None or not any(p.routed for p in prompts):
        return [None] * len(prompts)
    ids = capture.take().reshape(len(prompts), width, capture.layers, capture.top_k)
    return [ids[i, width - (len(p.token_ids) - p.start):] if p.routed else None for i, p in enumerate(prompts)]
