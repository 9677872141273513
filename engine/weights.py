"""Swap new weights into an already loaded model, in place: the refit step of an RL loop.

:func:`load_weights` reads a Hugging Face directory of safetensors files (never pickle: ``*.bin``
and ``*.pt`` could run code when read) into CPU tensors, checks everything before it touches the
model, then copies the tensors into the model's parameters under the model's lock and sets the new
``weight_version``. A directory that fails a check raises :class:`WeightsInvalidError` naming the
problem, and the model is left exactly as it was.

The checks, in order (each cheap before the next costs more):

1. the directory's ``config.json`` describes the loaded model (same architecture and every config
   field equal, except the ones that do not change what the model computes);
2. its safetensors headers name exactly the model's tensors with the model's shapes (read from
   the headers alone, no tensor bytes yet);
3. every tensor reads, converts to the dtype its parameter has (the dtype the model was loaded in)
   and is finite.

Only then are the tensors copied. The copy itself cannot fail half-way on a shape or dtype (both
were checked), and it runs under ``loaded.lock``, which every generate and score call holds.

Checkpoint names: transformers 5 renames some checkpoint keys on load (Qwen2-VL's
``model.layers.*`` becomes ``model.language_model.layers.*``) and writes the old names back on
save. ``revert_weight_conversion`` is the function ``save_pretrained`` uses for that, so the names
it gives are the names a checkpoint saved by transformers has; a directory may also use the
model's own names. Conversions that change tensors (fused or split weights) are not supported.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.loading import LoadedModel

# Config fields that may differ between checkpoints of one model: bookkeeping, and the dtype the
# checkpoint was saved in (tensors are converted to the loaded model's dtype anyway).
_CONFIG_IGNORED = frozenset({"transformers_version", "_name_or_path", "dtype", "torch_dtype", "_commit_hash",
                             "_attn_implementation_autoset"})
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
_INDEX = "model.safetensors.index.json"


class WeightsInvalidError(InvalidRequestError):
    """The directory cannot be swapped into the loaded model; ``errors["problem"]`` says why."""

    code = "weights_invalid"

    def __init__(self, message: str, *, problem: str, **details: Any):
        super().__init__(message, errors={"problem": problem, **details})
        self.problem = problem


@dataclass(frozen=True)
class WeightSwap:
    """What one swap did (for logs and the per-worker report)."""

    weight_version: str
    previous_version: str
    tensors: int
    bytes: int
    read_s: float
    copy_s: float


def load_weights(loaded: LoadedModel, directory: str | Path, *, weight_version: str) -> WeightSwap:
    """Swap the weights of ``directory`` into ``loaded.model`` and set ``loaded.weight_version``.

    Raises :class:`WeightsInvalidError` (the model unchanged) when the directory is not a
    checkpoint of the loaded model. Holds every new tensor on the CPU until the copy: host memory
    for one more copy of the weights.
    """
    directory = Path(directory)
    started = time.perf_counter()
    check_config(loaded.model.config.to_dict(), directory, architecture=loaded.architecture)
    targets = _targets_by_checkpoint_name(loaded.model)
    headers = read_headers(directory)
    plan = _plan(headers, targets)
    new = _read_tensors(directory, headers, plan)
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    with loaded.lock, torch.no_grad():
        for name, tensor in new.items():
            plan[name].copy_(tensor)
        previous = loaded.weight_version
        loaded.weight_version = weight_version
    return WeightSwap(weight_version=weight_version, previous_version=previous, tensors=len(new),
                      bytes=sum(t.numel() * t.element_size() for t in new.values()), read_s=read_s,
                      copy_s=time.perf_counter() - started)


def check_checkpoint(directory: str | Path, reference: str | Path) -> None:
    """Check ``directory`` against the model directory ``reference`` from config and safetensors
    headers only (no tensor bytes, no model): what an API process can check before it asks the
    workers to load. The workers' :func:`load_weights` checks all of it again, and more."""
    from transformers import AutoConfig

    directory, reference = Path(directory), Path(reference)
    try:
        reference_config = AutoConfig.from_pretrained(reference, local_files_only=True)
    except (OSError, ValueError):
        reference_config = None
    if reference_config is not None:
        check_config(reference_config.to_dict(), directory, architecture=(reference_config.architectures or [None])[0])
    new = read_headers(directory)
    if not reference.is_dir():
        return  # a hub id: its tensors are compared by each worker against the loaded model
    known = read_headers(reference)
    for name, (_, shape, _) in new.items():
        if name not in known:
            raise WeightsInvalidError(f"tensor {name!r} is not a tensor of this model", problem="unexpected_tensor",
                                      tensor=name)
        if known[name][1] != shape:
            raise WeightsInvalidError(
                f"tensor {name!r} has shape {list(shape)}; the model's is {list(known[name][1])}",
                problem="shape_mismatch", tensor=name, shape=list(shape), expected=list(known[name][1]))
    missing = sorted(set(known) - set(new))
    if missing:
        raise WeightsInvalidError(f"the checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[0]!r}",
                                  problem="missing_tensor", tensor=missing[0], missing=len(missing))


def check_config(reference: Mapping[str, Any], directory: Path, *, architecture: str | None = None) -> None:
    """Raise :class:`WeightsInvalidError` unless ``directory/config.json`` matches ``reference``
    (a ``PretrainedConfig.to_dict()``) in every field that changes what the model computes."""
    from transformers import AutoConfig

    if not directory.is_dir():
        raise WeightsInvalidError("the weights path is not a directory", problem="not_a_directory")
    if not (directory / "config.json").is_file():
        raise WeightsInvalidError("the weights directory has no config.json", problem="no_config")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True).to_dict()
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        raise WeightsInvalidError("the weights directory's config.json cannot be read", problem="bad_config") from None
    if config.get("model_type") != reference.get("model_type"):
        raise WeightsInvalidError(
            f"the weights are a {config.get('model_type')!r} model; this model is {reference.get('model_type')!r}",
            problem="architecture_mismatch")
    declared = config.get("architectures") or []
    if architecture and declared and architecture not in declared:
        raise WeightsInvalidError(f"the weights are for {declared[0]!r}; this model is {architecture!r}",
                                  problem="architecture_mismatch")
    differing = sorted(_differences(_without_ignored(reference), _without_ignored(config)))
    if differing:
        raise WeightsInvalidError(f"the weights' config differs from the model's in {', '.join(differing[:5])}",
                                  problem="config_mismatch", fields=differing[:20])


def read_headers(directory: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """``{checkpoint tensor name: (file name, shape, safetensors dtype)}`` from the headers alone."""
    from safetensors import SafetensorError, safe_open

    files = safetensors_files(directory)
    headers: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if name in headers:
                        raise WeightsInvalidError(f"tensor {name!r} is in two files", problem="duplicate_tensor",
                                                  tensor=name)
                    part = handle.get_slice(name)
                    headers[name] = (path.name, tuple(part.get_shape()), part.get_dtype())
        except (SafetensorError, OSError):
            raise WeightsInvalidError(f"{path.name} is not a readable safetensors file", problem="bad_file",
                                      file=path.name) from None
    return headers


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every ``*.safetensors``."""
    index = directory / _INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise WeightsInvalidError(f"{_INDEX} cannot be read", problem="bad_index") from None
        files = [directory / name for name in names]
        if any(Path(name).name != name or not path.is_file() for name, path in zip(names, files, strict=True)):
            raise WeightsInvalidError(f"{_INDEX} names a file the directory lacks", problem="bad_index")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickled = any(directory.glob(pattern) for pattern in _PICKLE_PATTERNS)
        raise WeightsInvalidError(
            "the weights directory has pickle checkpoints only; save with safetensors" if pickled
            else "the weights directory has no safetensors files", problem="no_safetensors")
    return files


def _targets_by_checkpoint_name(model) -> dict[str, torch.Tensor]:
    """The model's state dict under both the names a saved checkpoint uses and its own names."""
    from transformers.core_model_loading import revert_weight_conversion

    own = model.state_dict()
    by_identity = {id(tensor): tensor for tensor in own.values()}
    saved = revert_weight_conversion(model, dict(own))
    targets = dict(own)
    for name, tensor in saved.items():
        if id(tensor) not in by_identity:  # a conversion that made a new tensor (fused/split weights)
            raise WeightsInvalidError("this architecture's checkpoints convert tensors on load; in-place weight "
                                      "updates support renamed tensors only", problem="unsupported_conversion")
        targets.setdefault(name, tensor)
    return targets


def _plan(headers, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{checkpoint name: model tensor}``; every model tensor covered once (tied ones together)."""
    plan: dict[str, torch.Tensor] = {}
    for name, (_, shape, _) in headers.items():
        target = targets.get(name)
        if target is None:
            raise WeightsInvalidError(f"tensor {name!r} is not a tensor of this model", problem="unexpected_tensor",
                                      tensor=name)
        if tuple(target.shape) != shape:
            raise WeightsInvalidError(
                f"tensor {name!r} has shape {list(shape)}; the model's is {list(target.shape)}",
                problem="shape_mismatch", tensor=name, shape=list(shape), expected=list(target.shape))
        plan[name] = target
    # Tied parameters share storage: one of them in the checkpoint covers them all.
    covered = {_storage(t) for t in plan.values()}
    if len(covered) != len(plan):
        raise WeightsInvalidError("the checkpoint holds one model tensor under two names", problem="duplicate_tensor")
    missing = sorted({name for name, t in targets.items() if _storage(t) not in covered}
                     & set(_own_names(targets)))
    if missing:
        raise WeightsInvalidError(f"the checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[0]!r}",
                                  problem="missing_tensor", tensor=missing[0], missing=len(missing))
    return plan


def _own_names(targets: dict[str, torch.Tensor]) -> list[str]:
    # Each storage once, under any of its names: the missing check reports storages, not aliases.
    seen: dict[tuple, str] = {}
    for name, tensor in targets.items():
        seen.setdefault(_storage(tensor), name)
    return list(seen.values())


def _storage(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def _read_tensors(directory: Path, headers, plan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in headers.items():
        by_file.setdefault(file, []).append(name)
    new: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        try:
            with safe_open(str(directory / file), framework="pt", device="cpu") as handle:
                for name in names:
                    tensor = handle.get_tensor(name)
                    target = plan[name]
                    if tensor.is_floating_point() != target.is_floating_point():
                        raise WeightsInvalidError(f"tensor {name!r} has dtype {tensor.dtype}; the model's is "
                                                  f"{target.dtype}", problem="dtype_mismatch", tensor=name)
                    tensor = tensor.to(target.dtype)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise WeightsInvalidError(f"tensor {name!r} holds NaN or infinite values",
                                                  problem="non_finite", tensor=name)
                    new[name] = tensor
        except (SafetensorError, OSError):
            raise WeightsInvalidError(f"{file} cannot be read", problem="bad_file", file=file) from None
    return new


def _without_ignored(config: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key not in _CONFIG_IGNORED}


def _differences(a: Any, b: Any, prefix: str = "") -> set[str]:
    """Dotted names of the fields where two config dicts differ (sub-configs compared field by field)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out: set[str] = set()
        for key in set(a) | set(b):
            if key in _CONFIG_IGNORED:
                continue
            out |= _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return set() if a == b else {prefix.rstrip(".")}
