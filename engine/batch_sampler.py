"""One step's tokens for every row at once: the raw distribution's logprobs and top-k for all rows
in one pass, the per-row adjustments (min_tokens mask, penalties) only for the rows that have
them, one batched argmax for the greedy rows, one batched draw for the sampled ones
(:func:`engine.sampling.sample_rows`), and one device-to-host copy of the tokens and their
logprobs together.

Logprobs are the raw distribution's (what trainers feed their loss), never the processed one's.
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
from engine.errors import NonFiniteOutputError
from engine.sampling import sample_rows


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


def sample_step(rows: Sequence[RowDecoder], jobs: Sequence[Any], logits: torch.Tensor, *,
                placeholder_ids: torch.Tensor | None, events: list[RowTokens], batch_rows: int,
                fail: Callable[[Any, BaseException], None]) -> torch.Tensor:
    """Each row's token from its raw ``logits`` (rows, vocab), recorded on its decoder with its
    logprobs; a row that raises ends its job alone (``fail(job, error)``). ``jobs[i]`` is row i's
    job (``tag``, ``peak_rows``, ``first_token_at``); ``batch_rows``: the rows of this step."""
    for job in jobs:
        job.peak_rows = max(job.peak_rows, batch_rows)
    live = [i for i, row in enumerate(rows) if not row.done]
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    scores = without_placeholders(logits, placeholder_ids)
    failed: set[int] = set()
    if adjusted := [i for i in live if rows[i].adjusts]:
        scores = scores.clone()
        for i in adjusted:
            try:
                scores[i] = rows[i].adjust(scores[i])
            except Exception as error:  # this row's request ends alone
                fail(jobs[i], error)
                failed.add(i)
    tokens = scores.argmax(dim=-1)  # the greedy rows' tokens
    if sampled := [i for i in live if not rows[i].params.greedy and i not in failed]:
        try:
            index = torch.tensor(sampled, device=logits.device)
            tokens[index] = sample_rows(scores.index_select(0, index), [rows[i].params for i in sampled],
                                        [rows[i].generator for i in sampled])
        except Exception:  # a broken batched draw: each row alone, so one bad row ends alone
            for i in sampled:
                try:
                    tokens[i] = sample_rows(scores[i:i + 1], [rows[i].params], [rows[i].generator])[0]
                except Exception as row_error:
                    fail(jobs[i], row_error)
                    failed.add(i)
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
    top_k = max((rows[i].params.top_logprobs for i in live), default=0)
    top = torch.topk(raw_logprobs, top_k) if top_k else None
    # A NaN or +inf logit makes the row's log-softmax NaN or its normalizer infinite, so the chosen
    # token's logprob is not finite: one check of a value per row, where a scan of the logits cost
    # 2 % of a decode step on the demo model.
    finite = torch.isfinite(chosen).to(chosen.dtype)
    host_tokens, host_logprobs, host_finite = torch.stack([tokens.to(chosen.dtype), chosen, finite]).tolist()  # one copy
    for i in live:
        if i in failed:
            continue
        if not host_finite[i]:  # its request ends alone; no token of a NaN distribution is kept
            fail(jobs[i], NonFiniteOutputError(
                "the model's forward gave NaN or infinite logits for this request (its inputs overflow the model)",
                errors={"choice": rows[i].choice_index, "tokens_so_far": len(rows[i].token_ids)}))
            continue
        row, job = rows[i], jobs[i]
        token, logprob, k = int(host_tokens[i]), host_logprobs[i], row.params.top_logprobs
        row.note_sampled(tokens[i])
        row.add_logprobs(logprob, top.values[i, :k] if k else None, top.indices[i, :k] if k else None)
        row.record(token, aborted=False)
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
        events.append(RowTokens(job.tag, row.choice_index, token, logprob if row.params.logprobs else None,
                                row.finish_reason))
    return tokens
