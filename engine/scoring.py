"""Teacher-forced scoring: the logprob of each completion token after its prompt (with media).

All requests go through one forward pass, left-padded as in generation, so every row's
completion ends in the last column and only the last ``max completion + 1`` logits are
computed (``logits_to_keep``; a model that ignores it returns all of them, and the last
``max completion + 1`` are taken). Logprobs are log_softmax of the raw logits, as in generation:
scoring the tokens a greedy generation produced gives its logprobs back (tests: atol 1e-4;
measured ~1e-6 on fp32 CPU). Memory: the forward holds rows x (longest completion + 1) x vocab
logits, so the caller bounds the batch (16 rows x 2k tokens x 152k vocab in bf16 is ~10 GB).

:func:`teacher_forced` is the forward pass itself, shared with generation's prompt logprobs
(``SamplingParams.prompt_logprobs``), which score a prompt's own tokens from the second on.

The completion is text to the model: Qwen-VL's ``mm_token_type_ids`` are 0 over the appended
tokens (transformers 5.x needs them extended). A completion holding a media placeholder id is
refused: the model would take it for a media slot (generation never feeds it back that way).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.batch_inputs import (
    Row,
    check_placeholders,
    check_prompt,
    collate,
    prompt_positions,
    request_features,
)
from engine.errors import InvalidRequestError, check_token_ids
from engine.items import MultimodalItem
from engine.loading import LoadedModel
from engine.lora.bank import check_adapter, lora_rows
from engine.routing.capture import router_capture
from engine.routing.encoding import pack
from engine.routing.forwards import recording
from engine.routing.result import check_routed


@dataclass
class ScoreRequest:
    prompt_token_ids: Sequence[int]
    completion_token_ids: Sequence[int]
    items: Sequence[MultimodalItem] = ()
    mm_kwargs: Mapping[str, torch.Tensor] | None = None
    adapter: str = ""  # the LoRA adapter scored under (engine/lora/); "" is the base
    routed_experts: bool = False  # return every position's routed experts (engine/routing/)


@dataclass
class ScoreResult:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]  # one per completion token
    usage: dict[str, int]
    timings: dict[str, float]
    weight_version: str
    # With routed_experts: every position's (prompt and completion) top-k expert ids per MoE
    # layer, packed as engine/routing/encoding.py says; None unless asked.
    routed_experts: dict | None = None


def score(loaded: LoadedModel, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
    """Score every request in one forward pass; results in request order."""
    started = time.perf_counter()
    rows = []
    capture = router_capture(loaded.model)
    for request in requests:
        if len(request.completion_token_ids) == 0:
            raise InvalidRequestError("completion_token_ids must not be empty")
        check_prompt(loaded, request.prompt_token_ids, len(request.completion_token_ids))
        check_token_ids(request.completion_token_ids, loaded.vocab_size, "completion_token_ids")
        features = request_features(request.items, request.mm_kwargs)
        check_placeholders(loaded, request.prompt_token_ids, features, request.completion_token_ids)
        check_adapter(loaded, request)
        check_routed(capture, request)
        rows.append(Row(
            token_ids=[*request.prompt_token_ids, *request.completion_token_ids],
            features=features,
            adapter=request.adapter,
        ))
    if not requests:
        return []
    routing = [r.routed_experts for r in requests]
    scored = teacher_forced(loaded, rows, [len(r.completion_token_ids) for r in requests], routing=routing)
    results = []
    for request, (logprobs, _), routed in zip(requests, scored, routing, strict=True):
        n = len(request.completion_token_ids)
        results.append(
            ScoreResult(
                prompt_token_ids=list(request.prompt_token_ids),
                completion_token_ids=list(request.completion_token_ids),
                logprobs=logprobs,
                usage={"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": n},
                timings={},
                weight_version=loaded.weight_version,
                routed_experts=pack(routed.cpu().numpy()) if request.routed_experts else None,
            )
        )
    elapsed = time.perf_counter() - started
    for result in results:
        result.timings["forward_s"] = elapsed
    return results


# Float32 logprob elements computed at once by ``scored_logprobs`` (256 MiB).
_LOGPROB_ELEMENTS = 2**26


def teacher_forced(
    loaded: LoadedModel, rows: Sequence[Row], scored: Sequence[int], *, top_k: int = 0,
    routing: list | None = None,
) -> list[tuple[list[float], list[list[list]] | None]]:
    """For each row, the raw-distribution logprobs of its last ``scored[i]`` tokens given all
    before them, in one forward pass; with ``top_k``, also ``[[token_id, logprob], ...]`` of
    the k most likely tokens at each of those positions. Rows are checked by the caller.
    ``routing``: a flag per row; each true one is replaced by the row's routed experts over all
    its tokens, (len, layers, k) on the device (engine/routing/)."""
    batch = collate(loaded, rows)
    keep = max(scored) + 1
    capture = router_capture(loaded.model) if routing else None
    with loaded.lock, torch.inference_mode(), lora_rows(loaded, [row.adapter for row in rows]), \
            recording(capture, routing or []):
        # The positions generation's prefill uses (transformers' own, M-RoPE with media included):
        # left to the model, a padded row would be numbered from the padding, and Qwen2.5-Omni's
        # thinker, which takes no mm_token_type_ids, would get 1-D text positions over its media.
        positions, _ = prompt_positions(loaded, batch)
        logits = loaded.model(**batch, position_ids=positions, use_cache=False, logits_to_keep=keep).logits
        if capture is not None and any(routing):
            ids = capture.take().reshape(len(rows), batch["input_ids"].shape[1], capture.layers, capture.top_k)
            routing[:] = [ids[i, -len(row.token_ids):] if want else None
                          for i, (row, want) in enumerate(zip(rows, routing, strict=True))]
    # logits_to_keep is optional: Qwen2.5-Omni's thinker and Qwen2-Audio take it in **kwargs and
    # return every position. Take the last ``keep`` columns of whatever came back.
    if logits.shape[1] < keep:
        raise RuntimeError(f"the model returned {logits.shape[1]} positions of logits, fewer than the {keep} scored")
    return scored_logprobs(logits[:, -keep:], rows, scored, top_k=top_k)


def scored_logprobs(
    logits: torch.Tensor, rows: Sequence[Row], scored: Sequence[int], *, top_k: int = 0
) -> list[tuple[list[float], list[list[list]] | None]]:
    """``teacher_forced``'s answer from the forward's last ``max(scored) + 1`` columns of logits.

    Every scored position of every row is gathered into (positions, vocab) matrices of at most
    ``_LOGPROB_ELEMENTS``: a log-softmax, a gather and a top-k per matrix (one for a usual batch)
    and one device-to-host copy for the whole batch, not one of each per row (each a kernel launch
    and a sync on a GPU). Column keep-1 predicts nothing we score; the n columns before it predict
    the row's last n tokens.
    """
    keep = logits.shape[1]
    device = logits.device
    row_index = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(scored)]).to(device)
    column = torch.cat([torch.arange(keep - 1 - n, keep - 1) for n in scored]).to(device)
    targets = torch.as_tensor([t for row, n in zip(rows, scored, strict=True) for t in row.token_ids[len(row.token_ids) - n:]],
                              dtype=torch.long, device=device)
    # In slices of positions, so the float32 copy stays bounded (8k scored tokens of a 152k
    # vocabulary would be 5 GB at once); what each slice keeps is small and stays on the device.
    step = max(1, _LOGPROB_ELEMENTS // logits.shape[-1])
    chosen_parts, top_parts = [], []
    for start in range(0, len(targets), step):
        part = slice(start, start + step)
        logprobs = torch.log_softmax(logits[row_index[part], column[part]].float(), dim=-1)
        chosen_parts.append(logprobs.gather(1, targets[part, None]))
        if top_k:
            values, ids = torch.topk(logprobs, top_k, dim=-1)
            top_parts.append(torch.cat([values, ids.to(values.dtype)], dim=1))
    # One copy for everything: top-k ids travel as float32 beside the logprobs (exact: every
    # vocabulary is < 2**24).
    host = torch.cat([torch.cat(chosen_parts), *([torch.cat(top_parts)] if top_k else [])], dim=1).cpu()
    chosen_list = host[:, 0].tolist()
    if top_k:
        top_values, top_ids = host[:, 1:1 + top_k].tolist(), host[:, 1 + top_k:].long().tolist()
    out, at = [], 0
    for n in scored:
        top = None
        if top_k:
            top = [[[t, v] for t, v in zip(step_ids, step_values, strict=True)]
                   for step_ids, step_values in zip(top_ids[at:at + n], top_values[at:at + n], strict=True)]
        out.append((chosen_list[at:at + n], top))
        at += n
    return out
