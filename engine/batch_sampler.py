"""One step's tokens for every row at once: the raw distribution's logprobs and top-k for all rows
in one pass, the structured-output masks of the constrained rows in one pass over them
(engine/grammar/row_grammar.py), the per-row adjustments (min_tokens mask, penalties) only for
the rows that have them, one batched argmax for the greedy rows, one batched draw for the sampled ones
(:func:`engine.sampling.sample_rows`), and one device-to-host copy of the tokens and their
logprobs together.

Logprobs are the raw distribution's (what trainers feed their loss) unless a row asks for
``logprobs_mode`` "processed"; the rows that ask for it or for a sampling mask get their processed
distribution from one batched pass over them (engine/processed_rows.py), with one more copy to
the host for the masks, on steps where some row asked for one; other steps keep no distribution.
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
from engine.processed_rows import processed_rows
from engine.sampling import draw_rows


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


def _constrained(scores: torch.Tensor, rows: Sequence[RowDecoder], jobs: Sequence[Any], constrained: list[int],
                 fail: Callable[[Any, BaseException], None], failed: set[int]) -> torch.Tensor:
    """``scores`` with each constrained row's grammar mask (engine/grammar/row_grammar.py)."""
    # Imported here: xgrammar loads only in a process that serves a constrained request.
    from engine.grammar.row_grammar import apply_grammars

    try:
        return apply_grammars(scores, [rows[i].grammar for i in constrained], constrained)
    except Exception as error:  # their requests end; the free rows go on
        for i in constrained:
            fail(jobs[i], error)
            failed.add(i)
        return scores


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
    if constrained := [i for i in live if rows[i].grammar is not None]:
        scores = _constrained(scores, rows, jobs, constrained, fail, failed)
    if adjusted := [i for i in live if rows[i].adjusts]:
        scores = scores.clone()
        for i in adjusted:
            try:
                scores[i] = rows[i].adjust(scores[i])
            except Exception as error:  # this row's request ends alone
                fail(jobs[i], error)
                failed.add(i)
    tokens = scores.argmax(dim=-1)  # the greedy rows' tokens
    asked = [i for i in live if rows[i].params.processed]
    sampled_probs = None  # kept only when some row asked for it
    if sampled := [i for i in live if not rows[i].params.greedy and i not in failed]:
        try:
            index = torch.tensor(sampled, device=logits.device)
            draw = draw_rows(scores.index_select(0, index), [rows[i].params for i in sampled],
                             [rows[i].generator for i in sampled])
            tokens[index] = draw.tokens
            sampled_probs = draw.probs if asked else None
        except Exception:  # a broken batched draw: each row alone, so one bad row ends alone
            probs = []
            for i in sampled:
                try:
                    draw = draw_rows(scores[i:i + 1], [rows[i].params], [rows[i].generator])
                    tokens[i] = draw.tokens[0]
                    probs.append(draw.probs)
                except Exception as row_error:
                    fail(jobs[i], row_error)
                    failed.add(i)
                    probs.append(torch.zeros_like(scores[i:i + 1]))  # never read: the row failed
            sampled_probs = torch.cat(probs) if asked else None
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
    top_k = max((rows[i].params.top_logprobs for i in live if rows[i].params.logprobs_mode == "raw"), default=0)
    top = torch.topk(raw_logprobs, top_k) if top_k else None
    processed, reported = None, chosen
    if asked := [i for i in asked if i not in failed]:
        processed = processed_rows(
            asked, sampled, sampled_probs, tokens,
            top_k=max((rows[i].params.top_logprobs for i in asked if rows[i].params.logprobs_mode == "processed"),
                      default=0),
            masked=[rows[i].params.sampling_mask for i in asked])
        reported = chosen.index_copy(0, processed.rows, processed.logprobs)
    # A NaN or +inf logit makes the row's log-softmax NaN or its normalizer infinite, so the chosen
    # token's logprob is not finite: one check of a value per row, where a scan of the logits cost
    # 2 % of a decode step on the demo model.
    finite = torch.isfinite(chosen).to(chosen.dtype)
    host = torch.stack([tokens.to(chosen.dtype), chosen, finite, *([reported] if processed else [])]).tolist()  # one copy
    host_tokens, host_logprobs, host_finite = host[:3]
    position = {row: j for j, row in enumerate(asked)}
    for i in live:
        if i in failed:
            continue
        if not host_finite[i]:  # its request ends alone; no token of a NaN distribution is kept
            fail(jobs[i], NonFiniteOutputError(
                "the model's forward gave NaN or infinite logits for this request (its inputs overflow the model)",
                errors={"choice": rows[i].choice_index, "tokens_so_far": len(rows[i].token_ids)}))
            continue
        row, job = rows[i], jobs[i]
        token = int(host_tokens[i])
        row.note_sampled(tokens[i])
        if row.params.sampling_mask:
            row.add_mask(processed.masks[position[i]])
        k = row.params.top_logprobs
        if row.params.logprobs_mode == "processed":
            logprob, (values, ids), at = host[3][i], processed.top or (None, None), position[i]
        else:
            logprob, (values, ids), at = host_logprobs[i], top or (None, None), i
        row.add_logprobs(logprob, values[at, :k] if k else None, ids[at, :k] if k else None)
        try:
            row.record(token, aborted=False)
        except Exception as error:  # its grammar refused the token: its request ends alone
            fail(job, error)
            continue
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
        events.append(RowTokens(job.tag, row.choice_index, token, logprob if row.params.logprobs else None,
                                row.finish_reason))
    return tokens

