"""Which model the service runs: the configured one, or the built-in demo model."""

from __future__ import annotations

from pathlib import Path

from engine.demo_model import build_demo_model
from engine.errors import ModelLoadError
from workers.settings import Settings

DEMO_MODEL_NAME = "demo-qwen2-vl"


def resolve_model_path(settings: Settings) -> str:
    """A local directory or hub id; with none configured, the demo model (built once, offline)."""
    if settings.model:
        local = Path(settings.model).expanduser()
        if not local.is_dir() and (local.is_absolute() or settings.model.startswith(".") or local.exists()):
            raise ModelLoadError(f"ROLLOUT_MODEL={settings.model!r} is not a model directory")
        return settings.model
    return str(build_demo_model(Path(settings.state_dir) / "models" / DEMO_MODEL_NAME))


def model_id(settings: Settings) -> str:
    return settings.model or DEMO_MODEL_NAME


def context_length(model_path: str) -> int | None:
    """The model's context length from its config, without loading weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text_config = getattr(config, "text_config", None) or config
    return getattr(text_config, "max_position_embeddings", None)
