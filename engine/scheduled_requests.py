"""What the scheduler (:mod:`engine.scheduler`) keeps and reports per request: its job (request,
rows, media units, block names, the cached blocks it holds, its state and timing marks), the
counters of a whole engine, and what a request that ended gives back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.decoding import RowDecoder
from engine.encoder_cache import MediaUnit, tensors_hash, unit_key
from engine.grammar.for_request import row_grammar, start_grammar
from engine.model_facts import ModelFacts
from engine.prefix_hash import MediaSpan, PromptHashes, prompt_hashes
from engine.sampling import choice_seed
from engine.sampling_params import SamplingParams


@dataclass
class EngineStats:
    """Counters since the engine started (the GPU worker reports their growth as metrics)."""

    prefill_tokens: int = 0  # prompt tokens computed (real tokens, not padding)
    prefill_forwards: int = 0  # forwards that computed prompts (a chunk of a long prompt counts one)
    cached_tokens: int = 0  # prompt tokens served by cached KV blocks or a shared prefill
    decode_steps: int = 0
    preempted_requests: int = 0  # running requests stopped (and later resumed) to give another tenant its share
    decode_rows: int = 0  # sum over decode steps of the rows in them
    kv_live_tokens: int = 0  # sum over decode steps of the tokens the rows attend to
    kv_held_tokens: int = 0  # sum over decode steps of the KV pool's blocks in use, in tokens
    kv_read_tokens: int = 0  # sum over decode steps of rows x the longest row (what a left-padded cache holds)

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class Finished:
    """A request that ended: its result, or the error that ended it alone."""

    handle: int
    tag: Any
    result: Any = None  # engine.generation.GenerationResult
    error: BaseException | None = None
    timed_out: bool = False  # its deadline stopped it (its rows end with "abort")
    batch_rows: int = 0  # the most rows that decoded in one step with this request's rows


@dataclass(frozen=True)
class ChoiceSoFar:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None  # None: the request asked for none
    finish_reason: str | None


@dataclass
class Job:
    handle: int
    tag: Any
    request: Any  # GenerationRequest
    features: dict[str, torch.Tensor]
    units: list[MediaUnit]
    key: tuple
    names: PromptHashes | None  # its prompt's block names (None: prefix caching is off)
    rows: list[RowDecoder]
    time_limit: float | None  # seconds from admission: its deadline is set then
    state: str = "pending"  # pending -> admitted -> running -> done
    admitted_at: float | None = None
    admitted_wall: float | None = None
    first_token_at: float | None = None
    cached_tokens: int = 0
    error: BaseException | None = None
    timed_out: bool = False
    deadline: float | None = None
    preemptions: int = 0  # times it gave way to another key (engine/preemption.py)
    resuming: bool = False  # preempted, its rows' tokens kept: its next admission computes their KV again
    resume_mark: int = 0  # its longest row's tokens when it last resumed: it goes past them before it gives way again
    time_left: float | None = None  # its deadline's seconds left when preempted (its clock stops while it waits)
    abort_requested: bool = False
    peak_rows: int = 0
    prefix: list[int] = field(default_factory=list)  # cached blocks its prefill starts from (held)
    prefix_tokens: int = 0  # the tokens they hold
    grammar: Any = None  # engine.grammar.compiler.PendingGrammar: its constraint, compiling until admission

    @property
    def adapter(self) -> str:
        """The LoRA adapter its rows run under ("" is the base)."""
        return getattr(self.request, "adapter", "")

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def compute_len(self) -> int:
        """The prompt tokens its prefill computes: those after its cached blocks."""
        return self.prompt_len - self.prefix_tokens


@dataclass
class Chunking:
    """A long prompt being prefilled one chunk per step."""

    job: Job
    prefill: Any  # the runner's state (StepRunner.start_chunked)
    reused: int  # its tokens found in cached blocks


def new_job(facts: ModelFacts, handle: int, tag: Any, request, features: dict[str, torch.Tensor],
            time_limit: float | None, *, block_size: int, prefix_caching: bool) -> Job:
    """A submitted request as the scheduler runs it: its media units, the key of its prompt
    (scope, weights, tokens, media), its blocks' names (None: prefix caching is off) and a
    decoder per choice."""
    units, key, names = _weights_keyed(facts, request, features, block_size=block_size, prefix_caching=prefix_caching)
    eos = frozenset(facts.eos_token_ids)
    grammar = start_grammar(facts, request.sampling)
    rows = [RowDecoder(handle, c, request.sampling, _generator(facts, request.sampling, c),
                       prompt_token_ids=request.prompt_token_ids, eos_token_ids=eos, tokenizer=facts.tokenizer,
                       weight_version=facts.weight_version, adapter=getattr(request, "adapter", ""),
                       grammar=row_grammar(grammar, facts))
            for c in range(request.sampling.n)]
    return Job(handle, tag, request, features, units, key, names, rows, time_limit, grammar=grammar)


def rekey(facts: ModelFacts, job: Job, *, block_size: int, prefix_caching: bool) -> None:
    """``job`` under the weights serving now (after a swap it lives through): its media units,
    prompt key and block names carry the new version, so it never finds what the old weights
    computed, nor is what it computes found under the old version."""
    job.units, job.key, job.names = _weights_keyed(facts, job.request, job.features, block_size=block_size,
                                                   prefix_caching=prefix_caching)


def _weights_keyed(facts: ModelFacts, request, features, *, block_size: int, prefix_caching: bool):
    """Everything of a request named by the weights: its media units, its prompt's key (scope,
    weights, tokens, media) and its blocks' names (None: prefix caching is off)."""
    units = _media_units(facts, request, features)
    # The adapter (its id carries its version) is part of the scope: its KV is its own. Media units
    # are not: adapters never touch the encoders (engine/lora/adapter_files.py).
    adapter = getattr(request, "adapter", "")
    scope = f"{request.cache_scope}\x1flora:{adapter}" if adapter else request.cache_scope
    key = (scope, facts.weight_version, tuple(request.prompt_token_ids), tuple(unit.key for unit in units))
    names = None
    if prefix_caching:
        names = prompt_hashes(scope, facts.weight_version, request.prompt_token_ids, block_size,
                              [MediaSpan(*unit.span, unit.key) for unit in units])
    return units, key, names


def _media_units(facts: ModelFacts, request, features) -> list[MediaUnit]:
    """The request's media as encoder units: one per finalized item (by content hash), or all of
    its ready-made tensors as one unit."""
    if not features:
        return []
    if request.items and all(item.content_hash for item in request.items):
        return [MediaUnit(unit_key(facts.weight_version, f"{item.modality}:{item.content_hash}"), item.tensors(),
                          tuple(item.offset))
                for item in sorted(request.items, key=lambda i: i.offset)]
    media = set(facts.media_token_ids.values())
    at = [i for i, t in enumerate(request.prompt_token_ids) if t in media]
    return [MediaUnit(unit_key(facts.weight_version, tensors_hash(features)), features, (at[0], at[-1] + 1))]


def _generator(facts: ModelFacts, params: SamplingParams, choice: int) -> torch.Generator | None:
    """A seeded row's own generator; None for greedy rows and for unseeded ones (they share one
    draw per step: engine/sampling.py)."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device=facts.device)
    generator.manual_seed(choice_seed(params.seed, choice))
    return generator
