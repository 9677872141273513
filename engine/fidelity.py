"""The load-time fidelity check: the engine's logprobs for a model must be the model's own.

A trainer puts our logprobs in its loss; a wrong one does not fail, it bends training. A model
whose forward differs from what the engine relies on (one that ignores ``logits_to_keep``, takes
positions another way, or breaks under padding or the KV cache) gives wrong numbers without an
error. So before a worker takes work, one short forward pair on a fixed text prompt checks the
two ways the engine computes a logprob against the model's plain forward on the unpadded sequence:

- generation: greedy tokens through the scheduler (prefill, KV cache, decode positions), the
  checked row left-padded beside a shorter one;
- teacher-forced scoring of those tokens (``kind: "score"``, prompt logprobs), likewise padded.

Both must agree with the plain forward within the tolerance (by default 1e-3 nats in fp32, and
0.15 in 16-bit types, where kernels chosen by batch shape differ in the last bits), and every
greedy token must be the forward's most likely one up to that tolerance. Media is not exercised
here (the engine takes features the processors make, and this layer has none): the fidelity
contract test covers every architecture with its media (``tests/engine/test_fidelity_contract.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ModelFidelityError
from engine.generation import Engine
from engine.generation_types import GenerationRequest
from engine.sampling_params import SamplingParams
from engine.scoring import ScoreRequest

PROMPT = "The quick brown fox jumps over the lazy dog. A picture is worth a thousand words."
NEW_TOKENS = 4
_SCOPE = "rollout:fidelity-check"  # no API key has this cache scope: no job shares its KV blocks


def default_tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 0.15


@dataclass(frozen=True)
class FidelityReport:
    """Worst absolute differences (nats) from the model's plain forward, per engine path."""

    generation: float
    scoring: float
    tolerance: float
    tokens: int

    def as_dict(self) -> dict:
        return {"generation_max_diff": self.generation, "scoring_max_diff": self.scoring,
                "tolerance": self.tolerance, "tokens": self.tokens}


def check_fidelity(engine: Engine, *, tolerance: float | None = None) -> FidelityReport:
    """Run the check on ``engine``'s model; :class:`ModelFidelityError` (with the report in its
    ``errors``) when a path disagrees with the model's forward."""
    loaded = engine.loaded
    tolerance = default_tolerance(loaded.dtype) if tolerance is None else tolerance
    prompt = _prompt_ids(loaded)
    shorter = prompt[: max(1, len(prompt) // 2)]  # pads the checked row in both batched paths
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=True, detokenize=False)
    generated = engine.generate([GenerationRequest(prompt, params, cache_scope=_SCOPE),
                                 GenerationRequest(shorter, params, cache_scope=_SCOPE)])
    choice = generated[0].choices[0]
    scored = engine.score([ScoreRequest(prompt, choice.token_ids),
                           ScoreRequest(shorter, generated[1].choices[0].token_ids)])[0].logprobs

    sequence = torch.tensor([[*prompt, *choice.token_ids]], device=loaded.device)
    with loaded.lock, torch.inference_mode():
        logits = loaded.model(input_ids=sequence, attention_mask=torch.ones_like(sequence)).logits
    forward = torch.log_softmax(logits[0, len(prompt) - 1: -1].float(), dim=-1)
    own = forward.gather(1, torch.tensor(choice.token_ids, device=forward.device)[:, None])[:, 0].tolist()

    report = FidelityReport(
        generation=max(abs(a - b) for a, b in zip(choice.logprobs, own, strict=True)),
        scoring=max(abs(a - b) for a, b in zip(scored, own, strict=True)),
        tolerance=tolerance, tokens=len(own))
    # The engine never samples a media placeholder (engine/scheduler.py): the most likely other token.
    placeholders = torch.tensor(sorted(loaded.media_token_ids.values()), dtype=torch.long, device=forward.device)
    sampleable = forward.index_fill(-1, placeholders, -torch.inf) if len(placeholders) else forward
    greedy_gap = float((sampleable.max(dim=-1).values - torch.tensor(own, device=forward.device)).max())
    problems = {}
    if report.generation > tolerance:
        problems["generation"] = f"sampled-token logprobs differ from the model's forward by {report.generation:.3g}"
    if report.scoring > tolerance:
        problems["scoring"] = f"teacher-forced logprobs differ from the model's forward by {report.scoring:.3g}"
    if greedy_gap > tolerance:
        problems["greedy"] = f"a greedy token is {greedy_gap:.3g} nats below the forward's most likely one"
    if problems:
        raise ModelFidelityError(
            f"{loaded.architecture}: the engine's logprobs are not the model's own "
            f"({'; '.join(problems.values())}; tolerance {tolerance:g}); this worker takes no work",
            errors={**problems, **report.as_dict()})
    return report


def _prompt_ids(loaded) -> list[int]:
    """The fixed prompt's ids: its text through the model's tokenizer, or (a directory without
    one) the first ids that are neither media placeholders nor end-of-sequence."""
    if loaded.tokenizer is not None:
        ids = loaded.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        if len(ids) >= 2:
            return list(ids)
    skip = set(loaded.media_token_ids.values()) | set(loaded.eos_token_ids)
    return [t for t in range(min(loaded.vocab_size, 64)) if t not in skip][:16]
