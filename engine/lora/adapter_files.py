"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and check it
against the base model before anything is served from it (the config's checks, torch-free, are
engine/lora/adapter_config.py's).

Read through :class:`engine.checkpoint_dir.CheckpointDir` (confined under the weights root as a
weight update is: no symlink, regular files only). Every check runs before the adapter is handed to
the bank, so a refusal changes nothing: the target modules exist in the base's language model (an
adapter on the vision or audio encoder is refused: the encoder cache is shared by every adapter),
each pair of matrices fits its module (A is (r, in), B is (out, r)), every value is finite, the rank
is within the limit, and only what we compute as PEFT does is accepted (no DoRA, no biases, no
``modules_to_save``, no per-module rank or alpha patterns).

The scale is PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint_dir import CheckpointDir, WeightsInvalidError
from engine.lora.adapter_config import WEIGHTS_FILE, rank_and_scale, read_config
from engine.lora.errors import AdapterInvalidError

_PREFIX = "base_model.model."  # PEFT's saved names: base_model.model.<module>.lora_A.weight
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights, checked: per target module ``(A (r, in), B (out, r))`` in float32 on
    the CPU, and its scale."""

    rank: int
    scale: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def adaptable_modules(model) -> dict[str, torch.nn.Linear]:
    """The base's linear modules an adapter may target: the language model's and the output head.
    Encoders are left out on purpose: their outputs are cached once for every adapter."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    by_id = {id(module): name for name, module in model.named_modules()}
    prefix = by_id[id(decoder)] + "."
    out = {name: module for name, module in decoder.named_modules(prefix=prefix[:-1])
           if isinstance(module, torch.nn.Linear)}
    if isinstance(head, torch.nn.Linear):
        out[by_id[id(head)]] = head
    return out


def read_adapter(directory: str | Path, model, *, max_rank: int, root: str | Path | None = None) -> LoraAdapter:
    """The adapter in ``directory`` (under ``root`` when given), checked against ``model``; raises
    :class:`AdapterInvalidError` (or the directory's ``WeightsInvalidError`` as one) otherwise."""
    try:
        with CheckpointDir.open(directory, root=root) as checkpoint:
            config = read_config(checkpoint)
            rank, scale = rank_and_scale(config, max_rank)
            tensors = _tensors(checkpoint)
    except WeightsInvalidError as error:
        raise AdapterInvalidError(error.message, **error.errors) from None
    modules = _modules(tensors, adaptable_modules(model), rank, set(dict(model.named_modules())))
    _check_targets(config, modules)
    return LoraAdapter(rank, scale, modules)


def _tensors(checkpoint: CheckpointDir) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    path = checkpoint.path_of(WEIGHTS_FILE)
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError):
        raise AdapterInvalidError(f"{WEIGHTS_FILE} is not a safetensors file", problem="bad_weights") from None


def _modules(tensors: dict[str, torch.Tensor], targets: dict[str, torch.nn.Linear], rank: int,
             every_module: set[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key.removeprefix(_PREFIX))
        if not key.startswith(_PREFIX) or match is None:
            raise AdapterInvalidError(f"{key} is not a LoRA matrix of a linear module", problem="unsupported",
                                      tensor=key)
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise AdapterInvalidError(f"{WEIGHTS_FILE} holds no LoRA matrices", problem="bad_weights")
    out = {}
    for name, pair in sorted(pairs.items()):
        if name not in targets:
            problem = "encoder_module" if name in every_module else "unknown_module"
            raise AdapterInvalidError(f"{name} is not a linear module of the base's language model",
                                      problem=problem, module=name)
        if set(pair) != {"A", "B"}:
            raise AdapterInvalidError(f"{name} lacks lora_{'B' if 'A' in pair else 'A'}", problem="bad_weights",
                                      module=name)
        linear, a, b = targets[name], pair["A"], pair["B"]
        want_a, want_b = (rank, linear.in_features), (linear.out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterInvalidError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                                      f"the base's {want_a} and {want_b}", problem="shape_mismatch", module=name)
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterInvalidError(f"{name}: LoRA matrices must be floating point", problem="bad_weights",
                                      module=name)
        a, b = a.float(), b.float()
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise AdapterInvalidError(f"{name}: a LoRA matrix holds NaN or infinity", problem="non_finite",
                                      module=name)
        out[name] = (a.contiguous(), b.contiguous())
    return out


def _check_targets(config: dict, modules: dict) -> None:
    """Each listed target module names at least one module the weights adapt (PEFT's matching: a
    name equal to it or ending in ``.<it>``; a string is a regular expression over whole names)."""
    targets = config.get("target_modules")
    if targets is None or isinstance(targets, str):
        return  # a pattern names what it matches; the weights' own names were checked above
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterInvalidError("target_modules must be a list of names or a pattern", problem="bad_config",
                                  field="target_modules")
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in modules):
            raise AdapterInvalidError(f"target module {target!r} matches no weights of the adapter on this base",
                                      problem="unknown_module", module=target)
