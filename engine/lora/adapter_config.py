"""The torch-free part of an adapter's checks: its directory (confined under the weights root), its
``adapter_config.json`` (PEFT's LoRA, no DoRA, biases, ``modules_to_save`` or rank patterns; the
rank within the limit) and the presence of its weights file. The API runs these before it changes
the registry (a refusal with no GPU worker live too); each GPU worker then checks the weights
against the base (engine/lora/adapter_files.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from engine.checkpoint_dir import CheckpointDir, WeightsInvalidError
from engine.lora.errors import AdapterInvalidError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_MAX_CONFIG_BYTES = 1 << 20


def check_adapter_dir(directory: str | Path, *, root: str | Path | None, max_rank: int) -> dict:
    """The adapter's config once the directory, the config and the weights file pass; raises
    :class:`AdapterInvalidError` (with its ``problem``) otherwise."""
    try:
        with CheckpointDir.open(directory, root=root) as checkpoint:
            config = read_config(checkpoint)
            rank_and_scale(config, max_rank)
            checkpoint.fd(WEIGHTS_FILE)  # there, and a regular file
    except WeightsInvalidError as error:
        raise AdapterInvalidError(error.message, **error.errors) from None
    return config


def read_config(checkpoint: CheckpointDir) -> dict:
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


def rank_and_scale(config: dict, max_rank: int) -> tuple[int, float]:
    """The rank and PEFT's scale: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
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
