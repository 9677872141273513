"""A checkpoint directory on its own, without loading it: its version and its fit to a model.

Free of torch (safetensors headers are read through numpy, config through transformers' config
classes), so the API checks a weights directory before it asks the workers to load it;
``engine.weights`` checks all of it again, and more, when it swaps the tensors in. Every function
reads through a :class:`~engine.checkpoint_dir.CheckpointDir` (files opened once, regular files
only, confined under the weights root for updates).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.checkpoint_dir import CheckpointDir, WeightsInvalidError

# What a weight version is computed from: weight files and the configs (not the tokenizer).
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_CONFIG_FILES = ("config.json", "generation_config.json")

# Config fields that may differ between checkpoints of one model: bookkeeping, and the dtype the
# checkpoint was saved in (tensors are converted to the loaded model's dtype anyway).
_CONFIG_IGNORED = frozenset({"transformers_version", "_name_or_path", "dtype", "torch_dtype", "_commit_hash",
                             "_attn_implementation_autoset"})
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
_INDEX = "model.safetensors.index.json"


def weight_version_of(directory: Path | CheckpointDir) -> str:
    """A 16-hex-digit blake2b of the weight and config files (names and bytes).

    Content, not mtimes: a rebuilt identical checkpoint keeps its version, and an RL weight
    update that keeps every shape still changes it. It reads every weight byte (~1 s per GB).
    """
    if not isinstance(directory, CheckpointDir):
        with CheckpointDir.open(directory) as checkpoint:
            return weight_version_of(checkpoint)
    names = sorted({name for pattern in _WEIGHT_PATTERNS for name in directory.glob(pattern)}
                   | {name for name in _CONFIG_FILES if directory.has(name)})
    digest = hashlib.blake2b(digest_size=8)
    for name in names:
        digest.update(name.encode() + b"\0")
        for chunk in directory.chunks(name):
            digest.update(chunk)
    return digest.hexdigest()


def check_checkpoint(directory: CheckpointDir, reference: str | Path) -> None:
    """Check ``directory`` against the model directory ``reference`` from config and safetensors
    headers only (no tensor bytes, no model): what an API process can check before it asks the
    workers to load. The workers' :func:`load_weights` checks all of it again, and more."""
    from transformers import AutoConfig

    reference = Path(reference)
    try:
        reference_config = AutoConfig.from_pretrained(reference, local_files_only=True)
    except (OSError, ValueError):
        reference_config = None
    if reference_config is not None:
        check_config(reference_config.to_dict(), directory, architecture=(reference_config.architectures or [None])[0])
    new = read_headers(directory)
    if not reference.is_dir():
        return  # a hub id: its tensors are compared by each worker against the loaded model
    with CheckpointDir.open(reference) as served:
        known = read_headers(served)
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


def check_config(reference: Mapping[str, Any], directory: CheckpointDir, *, architecture: str | None = None) -> None:
    """Raise :class:`WeightsInvalidError` unless ``directory/config.json`` matches ``reference``
    (a ``PretrainedConfig.to_dict()``) in every field that changes what the model computes."""
    from transformers import CONFIG_MAPPING

    if not directory.has("config.json"):
        raise WeightsInvalidError("the weights directory has no config.json", problem="no_config")
    try:
        # What AutoConfig.from_pretrained does with a directory's config.json, from the bytes read
        # through the directory's descriptor (from_pretrained would open the path again).
        raw = json.loads(directory.read_bytes("config.json"))
        config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw).to_dict()
    except (ValueError, KeyError, TypeError, AttributeError):
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


def read_headers(directory: CheckpointDir) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """``{checkpoint tensor name: (file name, shape, safetensors dtype)}`` from the headers alone."""
    from safetensors import SafetensorError, safe_open

    headers: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for name in safetensors_files(directory):
        try:
            with safe_open(directory.path_of(name), framework="numpy") as handle:
                for tensor in handle.keys():
                    if tensor in headers:
                        raise WeightsInvalidError(f"tensor {tensor!r} is in two files", problem="duplicate_tensor",
                                                  tensor=tensor)
                    part = handle.get_slice(tensor)
                    headers[tensor] = (name, tuple(part.get_shape()), part.get_dtype())
        except (SafetensorError, OSError):
            raise WeightsInvalidError(f"{name} is not a readable safetensors file", problem="bad_file",
                                      file=name) from None
    return headers


def safetensors_files(directory: CheckpointDir) -> list[str]:
    """The checkpoint's safetensors file names: those its index names, else every ``*.safetensors``."""
    if directory.has(_INDEX):
        try:
            names = sorted(set(json.loads(directory.read_bytes(_INDEX))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise WeightsInvalidError(f"{_INDEX} cannot be read", problem="bad_index") from None
        if any(not isinstance(name, str) or Path(name).name != name or not directory.has(name) for name in names):
            raise WeightsInvalidError(f"{_INDEX} names a file the directory lacks", problem="bad_index")
        return names
    names = directory.glob("*.safetensors")
    if not names:
        pickled = any(directory.glob(pattern) for pattern in _PICKLE_PATTERNS)
        raise WeightsInvalidError(
            "the weights directory has pickle checkpoints only; save with safetensors" if pickled
            else "the weights directory has no safetensors files", problem="no_safetensors")
    return names


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
