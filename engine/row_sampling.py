"""Each row's next token from one forward's logits: one batched argmax for the plain greedy rows,
the row's own decoder (parameters, seeded generator, penalties) for the rest, and the raw
distribution's logprobs for all (what trainers feed their loss: never the processed one).

A media placeholder id is never drawn: fed back (the next turn of a rollout, a scoring call) it
would be taken for a media slot. Real checkpoints give them ~0 probability; tiny random ones do
not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.decoding import RowDecoder


@dataclass
class RowTokens:
    """One row's token of one step, for the per-step hook (streaming)."""

    tag: Any
    choice: int
    token_id: int
    logprob: float | None
    finish_reason: str | None  # set on the row's last token


def without_placeholders(logits: torch.Tensor, placeholder_ids: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with the media placeholder ids at -inf."""
    if placeholder_ids is None:
        return logits
    return logits.index_fill(-1, placeholder_ids.to(logits.device), -torch.inf)


def sample_rows(rows: Sequence[RowDecoder], jobs: Sequence[Any], logits: torch.Tensor, *,
                placeholder_ids: torch.Tensor | None, events: list[RowTokens], batch_rows: int,
                fail: Callable[[Any, BaseException], None]) -> torch.Tensor:
    """Each row's token from its raw ``logits`` (rows, vocab), recorded on its decoder with its
    logprobs; a row that raises ends its job alone (``fail(job, error)``). ``jobs[i]`` is row i's
    job (``tag``, ``peak_rows``, ``first_token_at``); ``batch_rows``: the rows of this step."""
    for job in jobs:
        job.peak_rows = max(job.peak_rows, batch_rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = without_placeholders(logits, placeholder_ids)
    tokens = torch.argmax(logits, dim=-1)  # one batched argmax serves the plain greedy rows
    for i, (row, job) in enumerate(zip(rows, jobs, strict=True)):
        if row.done:
            continue
        try:
            if not row.plain_greedy:
                tokens[i] = row.pick(logits[i])
            k = row.params.top_logprobs
            top = torch.topk(raw_logprobs[i], k) if k else None
            chosen = raw_logprobs[i, tokens[i]]
            row.add_logprobs(chosen, top.values if top is not None else None, top.indices if top is not None else None)
            token = int(tokens[i])
            row.record(token, aborted=False)
        except Exception as error:  # this row's request ends alone
            fail(job, error)
            continue
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
        events.append(RowTokens(job.tag, row.choice_index, token,
                                float(chosen) if row.params.logprobs else None, row.finish_reason))
    return tokens
