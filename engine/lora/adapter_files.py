"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and check it
against the base model before anything is served from it.

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

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint_dir import CheckpointDir, WeightsInvalidError
from engine.lora.errors import AdapterInvalidError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's saved names: base_model.model.<module>.lora_A.weight
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
_MAX_CONFIG_BYTES = 1 << 20


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
            config = _config(checkpoint)
            rank, scale = _rank_and_scale(config, max_rank)
            tensors = _tensors(checkpoint)
    except WeightsInvalidError as error:
        raise AdapterInvalidError(error.message, **error.errors) from None
    modules = _modules(tensors, adaptable_modules(model), rank, set(dict(model.named_modules())))
    _check_targets(config, modules)
    return LoraAdapter(rank, scale, modules)


def _config(checkpoint: CheckpointDir) -> dict:
    if not checkpoint.has(CONFIG_FILE):
        raise AdapterInvalidError(f"the adapter directory has no {CONFIG_FILE}", problem="missing_file",
                                  file=CONFIG_FILE)
    raw = checkpoint.read_bytes(CONFIG_FILE)
    if len(raw) > _MAX_CONFIG_BYTES:
        raise AdapterInvalidError(f"{CONFIG_FILE} is larger than 1 MiB", problem="bad_config")
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise AdapterInvalidError(f"{CONFIG_FILE} is not JSON", problem="bad_config") from None
    if not isinstance(config, dict):
        raise AdapterInvalidError(f"{CONFIG_FILE} is not a JSON object", problem="bad_config")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterInvalidError(f"peft_type {config.get('peft_type')!r} is not LORA", problem="unsupported",
                                  field="peft_type")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    for field, present in unsupported.items():
        if present:
            raise AdapterInvalidError(f"adapters with {field} are not served", problem="unsupported", field=field)
    return config


def _rank_and_scale(config: dict, max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterInvalidError("adapter_config.json's r must be a positive integer", problem="bad_config", field="r")
    if rank > max_rank:
        raise AdapterInvalidError(f"rank {rank} is above the limit {max_rank} (ROLLOUT_MAX_LORA_RANK)",
                                  problem="rank_too_large", rank=rank, limit=max_rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterInvalidError("adapter_config.json's lora_alpha must be a number", problem="bad_config",
                                  field="lora_alpha")
    return rank, float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


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
