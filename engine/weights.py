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

4. with ``digest_for``: the tensors' content digest (:func:`weights_digest`) equals the one the
   weight version is bound to (``digest_for(found)``: the first loader binds what it found). A trainer that overwrites ``latest/`` in place would
   otherwise have a restarted worker serve other weights under the same version label.

Only then are the tensors copied. The copy itself cannot fail half-way on a shape or dtype (both
were checked), and it runs under ``loaded.lock``, which every generate and score call holds.

Checkpoint names: transformers 5 renames some checkpoint keys on load (Qwen2-VL's
``model.layers.*`` becomes ``model.language_model.layers.*``) and writes the old names back on
save. ``revert_weight_conversion`` is the function ``save_pretrained`` uses for that, so the names
it gives are the names a checkpoint saved by transformers has; a directory may also use the
model's own names. Conversions that change tensors (fused or split weights) are not supported.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint_dir import CheckpointDir
from engine.checkpoints import WeightsInvalidError, check_config, read_headers
from engine.loading import LoadedModel
from engine.weight_parts import fused_parts


@dataclass(frozen=True)
class WeightSwap:
    """What one swap did (for logs and the per-worker report)."""

    weight_version: str
    previous_version: str
    tensors: int
    bytes: int
    read_s: float
    copy_s: float
    digest: str  # of the tensors swapped in (weights_digest)


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, by name: the same weights give the
    same digest however the files split them."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def load_weights(loaded: LoadedModel, directory: str | Path, *, weight_version: str,
                 root: str | Path | None = None,
                 digest_for: Callable[[str], str | None] | None = None) -> WeightSwap:
    """Swap the weights of ``directory`` into ``loaded.model`` and set ``loaded.weight_version``.
    With ``root`` (the weights root), the directory and its files are read only as they lie under it
    (:class:`~engine.checkpoint_dir.CheckpointDir`: no symlink, regular files only).

    Raises :class:`WeightsInvalidError` (the model unchanged) when the directory is not a
    checkpoint of the loaded model. Holds every new tensor on the CPU until the copy: host memory
    for one more copy of the weights.
    """
    started = time.perf_counter()
    with CheckpointDir.open(directory, root=root) as checkpoint:
        check_config(loaded.model.config.to_dict(), checkpoint, architecture=loaded.architecture)
        targets = _targets_by_checkpoint_name(loaded.model)
        headers = read_headers(checkpoint)
        plan = _plan(headers, targets)
        new = _read_tensors(checkpoint, headers, plan)
    digest = weights_digest(new)
    expected_digest = digest_for(digest) if digest_for is not None else None
    if expected_digest is not None and digest != expected_digest:
        raise WeightsInvalidError(
            f"{directory} no longer holds the weights version {weight_version!r} was first loaded as "
            "(overwritten in place?)", problem="content_changed", expected_digest=expected_digest, digest=digest)
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    with loaded.lock, torch.no_grad():
        for name, tensor in new.items():
            plan[name].copy_(tensor)
        previous = loaded.weight_version
        loaded.weight_version = weight_version
    return WeightSwap(weight_version=weight_version, previous_version=previous, tensors=len(new),
                      bytes=sum(t.numel() * t.element_size() for t in new.values()), read_s=read_s,
                      copy_s=time.perf_counter() - started, digest=digest)


def _targets_by_checkpoint_name(model) -> dict[str, torch.Tensor]:
    """The model's state dict under both the names a saved checkpoint uses and its own names."""
    from transformers.core_model_loading import revert_weight_conversion

    own = model.state_dict()
    by_identity = {id(tensor): tensor for tensor in own.values()}
    saved = revert_weight_conversion(model, dict(own))
    parts: dict = {}
    targets = dict(own)
    copies = [name for name, tensor in saved.items() if id(tensor) not in by_identity]
    if copies:  # an MoE checkpoint's per-expert weights, fused on load (engine/weight_parts.py)
        kept = {id(tensor) for tensor in saved.values()}
        parts = fused_parts(model, own, [name for name, t in own.items() if id(t) not in kept], copies)
        saved = {**saved, **parts}
    for name, tensor in saved.items():
        if id(tensor) not in by_identity and name not in parts:
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
    # A fused tensor is covered by its parts: views of its storage whose sizes add up to its own.
    parts: dict[int, int] = {}
    for target in plan.values():
        parts[target.untyped_storage().data_ptr()] = parts.get(target.untyped_storage().data_ptr(), 0) + target.numel()
    missing = sorted({name for name, t in targets.items()
                      if _storage(t) not in covered and parts.get(t.untyped_storage().data_ptr(), 0) < t.numel()}
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


def _read_tensors(directory: CheckpointDir, headers, plan: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in headers.items():
        by_file.setdefault(file, []).append(name)
    new: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        try:
            with safe_open(directory.path_of(file), framework="pt", device="cpu") as handle:
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
