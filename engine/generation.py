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

Logprobs are log_softmax of the raw logits (before penalties, temperature and truncation) at
the sampled token (and, with ``top_logprobs``, the k most likely tokens), computed as each step's
logits arrive rather than kept as ``output_logits`` (that would hold steps x rows x vocab floats
until the end). Prompt logprobs come from teacher-forced scoring (:mod:`engine.scoring`) of the
prompts that ask for them, one extra forward pass over those prompts after decoding.
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
from engine.decoding import DecodeState, RowDecoder, RowSampler, RowStopper
from engine.errors import InvalidRequestError
from engine.items import MultimodalItem
from engine.loading import LoadedModel
from engine.sampling import SamplingParams, choice_seed
from engine.scoring import ScoreRequest, ScoreResult, score, teacher_forced
from engine.weights import WeightSwap, load_weights


class Engine:
    """What a GPU worker holds: one loaded model, batched :meth:`generate` and :meth:`score`.

    Calls are serialized per model (``loaded.lock``); each call is one batch.
    """

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self._weights_listeners: list[Callable[[WeightSwap], None]] = []

    @property
    def weight_version(self) -> str:
        return self.loaded.weight_version

    def update_weights(self, directory, *, weight_version: str) -> WeightSwap:
        """Swap in the weights of ``directory`` (see :func:`engine.weights.load_weights`), then tell
        every cache that depends on the weights; a bad directory raises and changes nothing."""
        swap = load_weights(self.loaded, directory, weight_version=weight_version)
        for listener in list(self._weights_listeners):
            listener(swap)
        return swap

    def on_weights_changed(self, listener: Callable[[WeightSwap], None]) -> None:
        """Call ``listener(swap)`` after every weight swap, before the next batch: where a cache keyed
        by the weights (prompt KV, vision-encoder outputs) drops its entries. Caches that do not
        depend on the weights (the multimodal preprocessing cache) do not register."""
        self._weights_listeners.append(listener)

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
    # The stop token id (eos included) or stop string that ended the choice; None otherwise.
    matched_stop: int | str | None = None
    text: str | None = None  # detokenized tokens (see RowDecoder.text); None without detokenize
    # Per token, [[token_id, logprob], ...] of the top_logprobs most likely tokens (raw); None unless asked.
    top_logprobs: list[list[list]] | None = None


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    choices: list[Choice]
    usage: dict[str, int]
    timings: dict[str, float]
    weight_version: str
    placeholder_ranges: list[dict[str, Any]] = field(default_factory=list)
    # With sampling.prompt_logprobs: per prompt token, its logprob given the tokens before it
    # (None for the first), and the top k alternatives ([[token_id, logprob], ...]) when k > 0.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[list] | None] | None = None

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
        if request.sampling.stop and loaded.tokenizer is None:
            raise InvalidRequestError("stop strings need the model's tokenizer, which this model directory lacks",
                                      errors={"stop": ["not supported by this model"]})

    aborted = should_abort() if should_abort is not None else set()
    live = [i for i in range(len(requests)) if i not in aborted]
    eos = frozenset(loaded.eos_token_ids)
    rows = [
        RowDecoder(i, c, requests[i].sampling, _generator(loaded, requests[i].sampling, c),
                   prompt_token_ids=requests[i].prompt_token_ids, eos_token_ids=eos, tokenizer=loaded.tokenizer)
        for i in live
        for c in range(requests[i].sampling.n)
    ]
    state = DecodeState(rows=rows, fill_token_id=loaded.fill_token_id, should_abort=should_abort)
    if rows:
        _run(loaded, requests, features, state)
    finished = time.perf_counter()
    first = state.first_token_at or finished
    timings = {
        "prefill_s": first - started,
        "decode_s": finished - first,
    }
    scored_prompts = _prompt_logprobs(loaded, requests, features, [i for i in live if requests[i].sampling.prompt_logprobs is not None])
    if scored_prompts:
        timings["prompt_logprobs_s"] = time.perf_counter() - finished

    choices: dict[int, list[Choice]] = {i: [] for i in range(len(requests))}
    for row in rows:
        choices[row.request_index].append(
            Choice(
                index=row.choice_index,
                token_ids=list(row.token_ids),
                logprobs=row.logprobs(),
                finish_reason=row.finish_reason,
                matched_stop=row.matched_stop,
                text=row.text(),
                top_logprobs=row.top_logprobs(),
            )
        )
    results = []
    for i, request in enumerate(requests):
        if i in aborted:
            params = request.sampling
            empty_text = "" if params.detokenize and loaded.tokenizer is not None else None
            choices[i] = [Choice(c, [], [] if params.logprobs else None, "abort", text=empty_text,
                                 top_logprobs=[] if params.top_logprobs else None)
                          for c in range(params.n)]
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
                **scored_prompts.get(i, {}),
            )
        )
    return results


def _prompt_logprobs(loaded: LoadedModel, requests, features, wanted: list[int]) -> dict[int, dict[str, Any]]:
    """``{request index: {prompt_logprobs, prompt_top_logprobs}}`` by teacher-forced scoring."""
    if not wanted:
        return {}
    top_k = max(requests[i].sampling.prompt_logprobs for i in wanted)
    # The first prompt token has no logprob; a one-token prompt scores nothing (keep a row anyway).
    scored = teacher_forced(
        loaded,
        [Row(requests[i].prompt_token_ids, features[i]) for i in wanted],
        [max(len(requests[i].prompt_token_ids) - 1, 1) for i in wanted],
        top_k=top_k,
    )
    out = {}
    for i, (logprobs, top) in zip(wanted, scored, strict=True):
        length, k = len(requests[i].prompt_token_ids), requests[i].sampling.prompt_logprobs
        logprobs = logprobs[-(length - 1):] if length > 1 else []
        entry: dict[str, Any] = {"prompt_logprobs": [None, *logprobs]}
        if k:
            top = top[-(length - 1):] if length > 1 else []
            entry["prompt_top_logprobs"] = [None, *[step[:k] for step in top]]
        out[i] = entry
    return out


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

