"""Generation: every request goes through the continuous scheduler (:mod:`engine.scheduler`).

:meth:`Engine.generate` submits a call's requests to a scheduler and steps it until all ended
(a call's requests decode together, rows leaving as they finish); the GPU worker keeps one
scheduler running and submits jobs into it between steps (``workers/gpu/session.py``).

Why not transformers' sampler: ``generate(do_sample=True)`` draws every row from one RNG with one
set of parameters, so a request's tokens would depend on its batch neighbours. One batched call
per step samples every row with its own parameters (:mod:`engine.batch_sampler`,
:mod:`engine.sampling`), and a seeded row draws from its own ``torch.Generator``; the same seed and
inputs then give the same tokens alone or in any batch, as long as the model's logits for the row
agree (fp32 CPU: equal to ~1e-7 under padding, see tests; on GPU, kernels chosen by batch shape
can differ in the last bits, which may flip a near-tie).

Logprobs are log_softmax of the raw logits (before penalties, temperature and truncation) at the
sampled token (and, with ``top_logprobs``, the k most likely tokens), computed as each step's
logits arrive. Prompt logprobs come from teacher-forced scoring (:mod:`engine.scoring`) of the
prompt, one extra forward pass when its request ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace

from engine.choice import Choice
from engine.encoder_cache import EncoderCache
from engine.generation_types import GenerationRequest, GenerationResult
from engine.loading import LoadedModel
from engine.lora.adapter_files import LoraAdapter, read_adapter
from engine.lora.bank import AdapterBank
from engine.model_runner import ModelRunner
from engine.paged_kv import BlockPool
from engine.prompt_cache import PromptEnds
from engine.scheduler import EngineStats, Scheduler, SchedulerLimits, StepHook
from engine.scoring import ScoreRequest, ScoreResult, score
from engine.tenant_usage import TenantUsage
from engine.weights import WeightSwap, load_weights


class Engine:
    """What a GPU worker holds: one loaded model, its caches (vision-encoder outputs, recent
    prompts' KV), counters, and :meth:`generate` / :meth:`score` / :meth:`scheduler`.

    Forward passes are serialized per model (``loaded.lock``).
    """

    def __init__(self, loaded: LoadedModel, limits: SchedulerLimits | None = None, *, max_loras: int = 8,
                 max_lora_rank: int = 64, max_cpu_loras: int | None = None):
        self.loaded = loaded
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self._adapter_ids_seen: set[str] = set()
        self._schedulers: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # whose requests hold adapters
        self.limits = limits or SchedulerLimits()
        self.encoder_cache = EncoderCache(self.limits.encoder_cache_bytes)
        self.prompt_ends = PromptEnds(self.limits.prompt_cache_tokens)
        # The KV memory: one pool for this engine's schedulers, as a device has one memory. Its
        # free blocks stay cached by name (prefix reuse) until it needs them. Its schedulers step
        # from one thread.
        self.kv_pool = BlockPool(self.limits.kv_blocks, self.limits.kv_block_tokens)
        self.stats = EngineStats()
        self.usage = TenantUsage(self.limits.usage_half_life_s)  # each key's recent use, across its schedulers
        self._weights_listeners: list[Callable[[WeightSwap], None]] = []
        self.swaps = 0  # weight swaps so far: a scheduler living through one sees it change
        # The caches hold what the old weights computed: a swap empties them. (Block names carry
        # the weight version too, so nothing stale is found even before this runs.)
        self.on_weights_changed(lambda _swap: self.forget_cached())

    def forget_cached(self) -> None:
        """Drop what the weights computed: encoder outputs, cached KV blocks, prompts' last logits."""
        self.encoder_cache.clear()
        self.kv_pool.forget_names()
        self.prompt_ends.clear()

    @property
    def weight_version(self) -> str:
        return self.loaded.weight_version

    def scheduler(self, *, on_step: StepHook | None = None, limits: SchedulerLimits | None = None) -> Scheduler:
        """A continuous batch over this engine's model, sharing its caches and counters."""
        runner = ModelRunner(self.loaded, self.kv_pool, self.encoder_cache, self.stats)
        scheduler = Scheduler(self.loaded, runner, limits or self.limits, prompt_ends=self.prompt_ends,
                              stats=self.stats, usage=self.usage, on_step=on_step)
        self._schedulers.add(scheduler)
        return scheduler

    def adapters_in_use(self) -> set[str]:
        """The adapters the requests of this engine's schedulers run under (a retired one stays for them)."""
        return {adapter for scheduler in list(self._schedulers) for adapter in scheduler.adapters_in_use}

    def update_weights(self, directory, *, weight_version: str, root=None,
                       digest_for: Callable[[str], str | None] | None = None) -> WeightSwap:
        """Swap in the weights of ``directory`` (confined under ``root`` when given, and of the
        digest ``digest_for`` binds when given; see :func:`engine.weights.load_weights`), then tell
        every cache that depends on the weights; a bad directory raises and changes nothing."""
        swap = load_weights(self.loaded, directory, weight_version=weight_version, root=root,
                            digest_for=digest_for)
        self.swaps += 1
        for listener in list(self._weights_listeners):
            listener(swap)
        return swap

    def load_adapter(self, adapter_id: str, directory, *, root=None) -> LoraAdapter:
        """Read the PEFT adapter in ``directory`` (confined under ``root`` when given), check it
        against the base, and make it resident as ``adapter_id`` (engine/lora/). A refusal
        (``AdapterInvalidError``, ``AdapterLimitError``) changes nothing."""
        adapter = read_adapter(directory, self.loaded.model, max_rank=self.max_lora_rank, root=root)
        if adapter_id in self._adapter_ids_seen:
            # An id names one adapter's weights in KV block names: served again with other weights,
            # what the last ones computed must not be found (the service versions its ids anyway).
            self.forget_cached()
        self._adapter_ids_seen.add(adapter_id)
        with self.loaded.lock:
            if self.loaded.adapters is None:
                self.loaded.adapters = AdapterBank(self.loaded.model, max_loras=self.max_loras,
                                                   max_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras,
                                                   in_use=self.adapters_in_use)
            self.loaded.adapters.add(adapter_id, adapter)
        return adapter

    def unload_adapter(self, adapter_id: str) -> bool:
        """Requests naming ``adapter_id`` are refused from now on (``adapter_not_found``); the rows
        running under it finish, its slot given up when another adapter needs it (False: it was
        not served)."""
        with self.loaded.lock:
            return self.loaded.adapters is not None and self.loaded.adapters.retire(adapter_id)

    def abort_adapter(self, adapter_id: str) -> int:
        """End every request running under ``adapter_id`` at its next step (``finish_reason``
        abort, the tokens so far): an in-place update in mode abort; other adapters and the base go
        on. Safe from another thread (a flag each scheduler reads at its step). The count aborted."""
        aborted = 0
        for scheduler in list(self._schedulers):
            aborted += scheduler.abort_adapter(adapter_id)
        return aborted

    def replace_adapter(self, old: str, new: str, *, recompute_kv: bool = False) -> None:
        """``old``'s requests go on under ``new`` (loaded already) from their next token: an in-place
        update in mode keep (:meth:`engine.scheduler.Scheduler.replace_adapter`). Safe from another
        thread; ``old``, retired after, is dropped once no row holds it."""
        for scheduler in list(self._schedulers):
            scheduler.replace_adapter(old, new, recompute_kv=recompute_kv)

    @property
    def adapter_ids(self) -> list[str]:
        return [] if self.loaded.adapters is None else self.loaded.adapters.ids()

    def save_weights(self, directory) -> None:
        """Write the weights this engine serves to ``directory`` (transformers' ``save_pretrained``:
        a checkpoint :meth:`update_weights` reads back as the same tensors)."""
        self.loaded.model.save_pretrained(directory)

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
        on_step: StepHook | None = None,
    ) -> list[GenerationResult]:
        """Generate for all ``requests`` together; results in request order.

        ``should_abort`` is polled before the first step and after every step and returns the
        indices (into ``requests``) to stop now; their choices end with ``finish_reason="abort"``
        and the tokens so far. Raises the typed error of the first invalid request before any
        compute (:class:`ContextLengthError`, :class:`InvalidRequestError`, ...), and the error of
        a request that failed while running.
        """
        rows = sum(request.sampling.n for request in requests)
        scheduler = self.scheduler(on_step=on_step, limits=replace(self.limits, max_rows=max(rows, 1)))
        features = [scheduler.check(request) for request in requests]
        handles = [scheduler.submit(request, tag=i, features=f)
                   for i, (request, f) in enumerate(zip(requests, features, strict=True))]
        results: list[GenerationResult | None] = [None] * len(requests)
        try:
            while scheduler.has_work:
                if should_abort is not None:
                    for index in should_abort():
                        scheduler.abort(handles[index])
                for finished in scheduler.step():
                    if finished.error is not None:
                        raise finished.error
                    results[finished.tag] = finished.result
        finally:  # an error ends the call with other rows running: their blocks go back
            scheduler.close()
        return results

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Teacher-forced logprobs in one forward pass; see :func:`engine.scoring.score`."""
        return score(self.loaded, requests)


__all__ = ["Choice", "Engine", "GenerationRequest", "GenerationResult"]
