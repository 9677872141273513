"""The forwards of the continuous batch: what :mod:`engine.scheduler` decides, run on the model.

The scheduler (the policy: requests, admission, prefix lookup, the prefill plan, sampling and
results) hands this module finished decisions and gets tensors back; everything here touches the
model, the KV pool's memory and the vision encoder, and nothing here knows a request's state. The
cut is vLLM V1's (``Scheduler`` plans a step, ``GPUModelRunner`` executes it).

What it uses of transformers: the model's forward (its own mask building from a 2-D
``attention_mask`` and its ``DynamicCache`` for prefills; its attention over the paged cache's
``update`` seam for decode steps), its position handling (``_prepare_position_ids_for_generation``
via :func:`engine.batch_inputs.prompt_positions`: Qwen-VL's M-RoPE positions and per-row
``rope_deltas``) and its ``mm_encoder_outputs`` seam (media encoded before the forward, each unit
alone, cached by content).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.batch_inputs import Row, collate, prompt_positions
from engine.encoder_cache import (
    EncoderCache,
    MediaUnit,
    encode,
    encoder_input_names,
    supports_encoder_outputs,
)
from engine.loading import LoadedModel
from engine.lora.bank import lora_rows
from engine.paged_kv import BlockPool, prefix_cache, write_prompts
from engine.prefill_plan import chunk_end
from engine.prompt_cache import PrefilledPrompt
from engine.routing.capture import router_capture
from engine.routing.forwards import after_decode, after_prefill, recording
from engine.running_batch import RunningBatch
from engine.scoring import teacher_forced
from engine.step_runner import PromptInput


@dataclass
class ChunkedPrefill:
    """A long prompt prefilled a chunk per step: its whole-prompt inputs and positions, and the
    cache of the tokens done so far (its cached prefix to begin with)."""

    prompt: PromptInput
    batch: dict[str, torch.Tensor]
    positions: torch.Tensor
    rope_delta: int | None
    cache: Any = None
    done: int = 0
    routing: list = field(default_factory=list)  # each chunk's routed experts, if the prompt asked

    @property
    def finished(self) -> bool:
        return self.done >= len(self.prompt.token_ids)


class ModelRunner:
    """Runs one model's forwards for a scheduler (an :class:`engine.step_runner.StepRunner`):
    decode steps over the running batch, padded prefills of prompts (each after its cached blocks),
    chunks of a long prompt, prompt logprobs. Counts forwards in ``stats`` (the engine's
    ``EngineStats``). Forwards hold ``loaded.lock``."""

    def __init__(self, loaded: LoadedModel, pool: BlockPool, encoder_cache: EncoderCache | None, stats):
        self.loaded, self.pool, self.encoder_cache, self.stats = loaded, pool, encoder_cache, stats
        self.uses_encoder_outputs = supports_encoder_outputs(loaded.model)
        self._encoder_inputs = encoder_input_names(loaded.model) if self.uses_encoder_outputs else set()
        self.routing = router_capture(loaded.model)  # None unless the model has MoE layers (engine/routing/)

    @property
    def attn_implementation(self) -> str | None:
        """The attention the decoder layers run (what the decode mask is built for)."""
        config = self.loaded.model.config
        text = getattr(config, "get_text_config", lambda: config)()
        return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)

    def decode(self, batch: RunningBatch) -> torch.Tensor:
        """One decode forward over the running rows; each row's raw fp32 logits (rows, vocab)."""
        inputs = batch.decode_inputs()
        with self.loaded.lock, torch.inference_mode(), lora_rows(self.loaded, [job.adapter for job in batch.jobs]), \
                recording(self.routing, [row.routing is not None for row in batch.rows]):
            out = self.loaded.model(**inputs, use_cache=True, logits_to_keep=1)
            after_decode(self.routing, batch)
        return out.logits[:, -1].float()

    def prefill(self, prompts: Sequence[PromptInput]) -> list[PrefilledPrompt]:
        """One padded forward over ``prompts``, each from the end of its cached blocks (attended to
        from the pool): each prompt's KV written into blocks after its prefix, its last logits and
        its delta. Positions and deltas are the whole prompts' (M-RoPE ones continue from the
        cached part). The prefixes' references pass to the prompts, or back to the pool if this
        raises."""
        try:
            return self._prefill(prompts)
        except BaseException:
            for prompt in prompts:
                self._drop_prefix(prompt)
            raise

    def _prefill(self, prompts: Sequence[PromptInput]) -> list[PrefilledPrompt]:
        loaded = self.loaded
        batch = collate(loaded, [Row(p.token_ids, p.features) for p in prompts])
        positions, deltas = prompt_positions(loaded, batch)
        units = [unit for p in prompts for unit in p.units if unit.span[0] >= p.start]
        past = {}
        if any(p.start for p in prompts):
            # The rest of each prompt, right-aligned after its cached blocks (left-padded to the
            # longest): [padding | cached prefix][padding | rest]; the mask hides both paddings.
            rest = collate(loaded, [Row(p.token_ids[p.start:],
                                        p.features if any(u.span[0] >= p.start for u in p.units) else {})
                                    for p in prompts])
            width = max(p.start for p in prompts)
            cached_mask = torch.tensor([[0] * (width - p.start) + [1] * p.start for p in prompts],
                                       dtype=rest["attention_mask"].dtype, device=loaded.device)
            rest["attention_mask"] = torch.cat([cached_mask, rest["attention_mask"]], dim=1)
            positions = positions[..., -rest["input_ids"].shape[1]:]
            past["cache"] = prefix_cache(self.pool, [p.prefix for p in prompts], dtype=loaded.dtype)
            batch = rest
        kwargs = self._forward_inputs(batch, units)
        with loaded.lock, torch.inference_mode(), lora_rows(loaded, [p.adapter for p in prompts]), \
                recording(self.routing, [p.routed for p in prompts]):
            out = loaded.model(**kwargs, **past, position_ids=positions, use_cache=True, logits_to_keep=1)
            routing = after_prefill(self.routing, prompts, batch["input_ids"].shape[1])
        self.stats.prefill_forwards += 1
        prefixes = [p.prefix for p in prompts]
        for prompt in prompts:  # write_prompts takes them over, whatever happens
            prompt.prefix = []
        kvs = write_prompts(self.pool, _cache_of(out), [len(p.token_ids) for p in prompts], prefixes)
        logits = out.logits[:, -1].float()
        return [PrefilledPrompt(kv, logits[i].clone(), None if deltas is None else int(deltas[i]), kv.length,
                                routing[i]) for i, kv in enumerate(kvs)]

    def start_chunked(self, prompt: PromptInput) -> ChunkedPrefill:
        batch = collate(self.loaded, [Row(prompt.token_ids, prompt.features)])
        positions, deltas = prompt_positions(self.loaded, batch)
        state = ChunkedPrefill(prompt, batch, positions, None if deltas is None else int(deltas[0]))
        if prompt.prefix:
            state.cache = prefix_cache(self.pool, [prompt.prefix], dtype=self.loaded.dtype)
            state.done = prompt.start
        return state

    def prefill_chunk(self, state: ChunkedPrefill, chunk_tokens: int) -> PrefilledPrompt | None:
        """The next chunk of ``state``'s prompt (never ending inside a media item); the prefilled
        prompt once its last chunk ran (its prefix's references pass to it), else None. If this
        raises, the prefix goes back to the pool and ``state`` is done with."""
        try:
            return self._prefill_chunk(state, chunk_tokens)
        except BaseException:
            self.drop_chunked(state)
            raise

    def drop_chunked(self, state: ChunkedPrefill) -> None:
        """A chunked prefill given up (its request ended): its prefix goes back to the pool."""
        self._drop_prefix(state.prompt)

    def _drop_prefix(self, prompt: PromptInput) -> None:
        self.pool.release(prompt.prefix)
        prompt.prefix = []

    def _prefill_chunk(self, state: ChunkedPrefill, chunk_tokens: int) -> PrefilledPrompt | None:
        prompt = state.prompt
        length, start = len(prompt.token_ids), state.done
        end = chunk_end(start, length, chunk_tokens, [unit.span for unit in prompt.units],
                        media_in_one_forward=not self.uses_encoder_outputs)
        chunk_units = [unit for unit in prompt.units if start <= unit.span[0] < end]
        batch = {name: value[:, start:end] if name in ("input_ids", "mm_token_type_ids") else value
                 for name, value in state.batch.items()}
        batch["attention_mask"] = state.batch["attention_mask"][:, :end]
        if not chunk_units:
            batch = {name: value for name, value in batch.items()
                     if name in ("input_ids", "attention_mask", "mm_token_type_ids")}
        kwargs = self._forward_inputs(batch, chunk_units)
        with self.loaded.lock, torch.inference_mode(), lora_rows(self.loaded, [prompt.adapter]), \
                recording(self.routing, [prompt.routed]):
            out = self.loaded.model(**kwargs, position_ids=state.positions[..., start:end], cache=state.cache,
                                    use_cache=True, logits_to_keep=1)
            if prompt.routed and self.routing is not None:
                state.routing.append(self.routing.take())  # (end - start, layers, k)
        self.stats.prefill_forwards += 1
        state.cache = _cache_of(out)
        state.done = end
        if end < length:
            return None
        prefix, prompt.prefix = prompt.prefix, []  # write_prompts takes it over, whatever happens
        kv = write_prompts(self.pool, state.cache, [length], [prefix])[0]
        return PrefilledPrompt(kv, out.logits[0, -1].float().clone(), state.rope_delta, length,
                               torch.cat(state.routing) if state.routing else None)

    def prompt_routing(self, token_ids, features: dict[str, torch.Tensor], adapter: str = "") -> torch.Tensor:
        """The routed experts of a whole prompt, (len, layers, k), computed again by the model's
        forward over it alone (no cache): for the part of a prompt found in the prefix cache, which
        no forward of this request computed (engine/routing/)."""
        batch = collate(self.loaded, [Row(token_ids, features, adapter)])
        with self.loaded.lock, torch.inference_mode(), lora_rows(self.loaded, [adapter]), \
                recording(self.routing, [True]):
            positions, _ = prompt_positions(self.loaded, batch)
            self.loaded.model(**batch, position_ids=positions, use_cache=False, logits_to_keep=1)
            return self.routing.take()

    def prompt_logprobs(self, request, features: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``{prompt_logprobs, prompt_top_logprobs}`` of one request by teacher-forced scoring (the
        model's own forward over the prompt, as scoring computes it)."""
        length, k = len(request.prompt_token_ids), request.sampling.prompt_logprobs
        entry: dict[str, Any] = {"prompt_logprobs": [None]}  # the first prompt token has no logprob
        if k:
            entry["prompt_top_logprobs"] = [None]
        if length == 1:  # nothing to score: no forward
            return entry
        [(logprobs, top)] = teacher_forced(self.loaded, [Row(request.prompt_token_ids, features, request.adapter)],
                                           [length - 1],
                                           top_k=k)
        entry["prompt_logprobs"] += logprobs[-(length - 1):]
        if k:
            entry["prompt_top_logprobs"] += [step[:k] for step in top[-(length - 1):]]
        return entry

    def _forward_inputs(self, batch: dict[str, torch.Tensor], units: Sequence[MediaUnit]) -> dict[str, Any]:
        if not units or not self.uses_encoder_outputs:
            return dict(batch)
        kwargs = {name: value for name, value in batch.items() if name not in self._encoder_inputs}
        with torch.inference_mode():
            kwargs["mm_encoder_outputs"] = encode(self.loaded.model, [_on_device(u, self.loaded) for u in units],
                                                  self.encoder_cache)
        return kwargs


def _on_device(unit: MediaUnit, loaded: LoadedModel) -> MediaUnit:
    moved = {name: value.to(device=loaded.device, dtype=loaded.dtype) if value.is_floating_point()
             else value.to(loaded.device) for name, value in unit.features.items()}
    return MediaUnit(unit.key, moved, unit.span)


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
