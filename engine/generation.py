"""Batched generation: every request of a call decodes together in one ``generate`` call.

Why plain ``generate`` and not transformers' continuous batching: ``generate_batch`` /
``init_continuous_batching`` take token ids only; ``pixel_values`` are silently dropped by
``generate_batch`` and rejected by ``add_request`` (transformers 5.24), so they cannot serve a
multimodal request. Static batching with left padding and an attention mask can, and Qwen-VL's
M-RoPE index honours the mask (tests check a padded row against the same row alone).

Why a per-row sampler: ``generate(do_sample=True)`` draws every row from one RNG with one set of
parameters, so a request's tokens would depend on its batch neighbours. The engine runs
``generate`` greedily with a blank ``GenerationConfig`` and lets :mod:`engine.decoding` pick
each row's token with that row's parameters and its own seeded ``torch.Generator``; the same
seed and inputs then give the same tokens alone or in any batch, as long as the model's logits
for the row agree (fp32 CPU: equal to ~1e-7 under padding, see tests; on GPU, kernels chosen by
batch shape can differ in the last bits, which may flip a near-tie).

Logprobs are log_softmax of the raw logits (before temperature and truncation) at the sampled
token, computed as each step's logits arrive rather than kept as ``output_logits`` (that would
hold steps x rows x vocab floats until the end).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from engine.batch_inputs import (
    Row,
    check_placeholders,
    check_prompt,
    collate,
    placeholder_ranges,
    request_features,
)
from engine.decoding import DecodeRow, DecodeState, RowSampler, RowStopper
from engine.items import MultimodalItem
from engine.loading import LoadedModel
from engine.sampling import SamplingParams, choice_seed
from engine.scoring import ScoreRequest, ScoreResult, score


class Engine:
    """What a GPU worker holds: one loaded model, batched :meth:`generate` and :meth:`score`.

    Calls are serialized per model (``loaded.lock``); each call is one batch.
    """

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded

    @property
    def weight_version(self) -> str:
        return self.loaded.weight_version

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        should_abort: Callable[[], set[int]] | None = None,
    ) -> list[GenerationResult]:
        """All ``requests`` decode together in one batch; see :func:`generate`."""
        return generate(self.loaded, requests, should_abort=should_abort)

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Teacher-forced logprobs in one forward pass; see :func:`engine.scoring.score`."""
        return score(self.loaded, requests)


@dataclass
class GenerationRequest:
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    items: Sequence[MultimodalItem] = ()  # finalized items with real tensors, or
    mm_kwargs: Mapping[str, torch.Tensor] | None = None  # ready model kwargs (pixel_values, ...)
    enqueued_at: float | None = None  # time.time() when the job was queued, for timings


@dataclass
class Choice:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None  # per token, raw-distribution logprob; None unless asked
    finish_reason: str  # "stop" | "length" | "abort"


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    choices: list[Choice]
    usage: dict[str, int]
    timings: dict[str, float]
    weight_version: str
    placeholder_ranges: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def generate(
    loaded: LoadedModel,
    requests: Sequence[GenerationRequest],
    *,
    should_abort: Callable[[], set[int]] | None = None,
) -> list[GenerationResult]:
    """Generate for all ``requests`` in one batch; results in request order.

    ``should_abort`` is polled after every decode step and returns the indices (into
    ``requests``) to stop now; their choices end with ``finish_reason="abort"`` and the tokens so
    far. Raises :class:`ContextLengthError` / :class:`InvalidRequestError` before any compute.
    """
    started = time.perf_counter()
    started_wall = time.time()
    features = []
    for request in requests:
        check_prompt(loaded, request.prompt_token_ids, request.sampling.max_tokens)
        features.append(request_features(request.items, request.mm_kwargs))
        check_placeholders(loaded, request.prompt_token_ids, features[-1])

    aborted = should_abort() if should_abort is not None else set()
    live = [i for i in range(len(requests)) if i not in aborted]
    rows = [
        DecodeRow(i, c, requests[i].sampling, _generator(loaded, requests[i].sampling, c))
        for i in live
        for c in range(requests[i].sampling.n)
    ]
    state = DecodeState(
        rows=rows,
        prompt_width=max((len(requests[r.request_index].prompt_token_ids) for r in rows), default=0),
        eos_token_ids=frozenset(loaded.eos_token_ids),
        fill_token_id=loaded.fill_token_id,
        should_abort=should_abort,
    )
    sequences = _run(loaded, requests, features, state) if rows else None
    finished = time.perf_counter()

    first = state.first_token_at or finished
    timings = {
        "prefill_s": first - started,
        "decode_s": finished - first,
    }
    logprobs = state.logprobs() if rows else None
    choices: dict[int, list[Choice]] = {i: [] for i in range(len(requests))}
    for r, row in enumerate(rows):
        length = state.lengths[r]
        tokens = sequences[r, state.prompt_width : state.prompt_width + length].tolist()
        choices[row.request_index].append(
            Choice(
                index=row.choice_index,
                token_ids=tokens,
                logprobs=logprobs[r, :length].tolist() if row.params.logprobs else None,
                finish_reason=state.finish_reasons[r],
            )
        )
    results = []
    for i, request in enumerate(requests):
        if i in aborted:
            choices[i] = [Choice(c, [], [] if request.sampling.logprobs else None, "abort")
                          for c in range(request.sampling.n)]
        request_timings = dict(timings)
        if request.enqueued_at is not None:
            request_timings["queue_s"] = max(0.0, started_wall - request.enqueued_at)
        results.append(
            GenerationResult(
                prompt_token_ids=list(request.prompt_token_ids),
                choices=choices[i],
                usage={
                    "prompt_tokens": len(request.prompt_token_ids),
                    "completion_tokens": sum(len(c.token_ids) for c in choices[i]),
                },
                timings=request_timings,
                weight_version=loaded.weight_version,
                placeholder_ranges=placeholder_ranges(loaded, request.prompt_token_ids, request.items),
            )
        )
    return results


def _run(loaded: LoadedModel, requests, features, state: DecodeState) -> torch.Tensor:
    batch = collate(
        loaded,
        [Row(requests[r.request_index].prompt_token_ids, features[r.request_index]) for r in state.rows],
    )
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.params.max_tokens for r in state.rows),
        pad_token_id=loaded.fill_token_id,
        use_cache=True,
    )
    with loaded.lock, torch.inference_mode():
        return loaded.model.generate(
            **batch,
            generation_config=config,
            logits_processor=LogitsProcessorList([RowSampler(state)]),
            stopping_criteria=StoppingCriteriaList([RowStopper(state)]),
        )


def _generator(loaded: LoadedModel, params: SamplingParams, choice: int) -> torch.Generator | None:
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    generator = torch.Generator(device=loaded.device)
    generator.manual_seed(choice_seed(seed, choice))
    return generator

