"""Which model the service runs: the configured one, or the built-in demo model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from domain.settings import Settings
from engine.errors import ModelLoadError
from engine.routing.shape import routing_shape

# A tiny Qwen2.5-Omni thinker: it takes image, video and audio, so every content part can be tried.
DEMO_MODEL_NAME = "demo-qwen2.5-omni"
# The built-in models by name (ROLLOUT_DEMO_MODEL) and the demo architecture each is built as;
# demo-qwen3's chat template has tools and thinking (engine/demo_qwen3.py); demo-qwen3-moe is the
# mixture-of-experts text model whose routed experts can be asked (engine/demo_moe.py).
DEMO_ARCHS = {DEMO_MODEL_NAME: "qwen2_5_omni", "demo-qwen3": "qwen3_tools", "demo-qwen3-moe": "qwen3_moe"}


def resolve_model_path(settings: Settings) -> str:
    """A local directory or hub id; with none configured, the demo model (built once, offline)."""
    if settings.model:
        local = Path(settings.model).expanduser()
        if not local.is_dir() and (local.is_absolute() or settings.model.startswith(".") or local.exists()):
            raise ModelLoadError(f"ROLLOUT_MODEL={settings.model!r} is not a model directory")
        return settings.model
    from engine.demo_model import build_demo_model  # reusing a built one imports no torch

    name = settings.demo_model
    return str(build_demo_model(Path(settings.state_dir) / "models" / name, arch=DEMO_ARCHS[name]))


def model_id(settings: Settings) -> str:
    return settings.model or settings.demo_model


@dataclass(frozen=True)
class ModelFacts:
    """What the API and the submit path need to know of the model, read from its config only."""

    context_tokens: int | None  # the model's own context (max_position_embeddings)
    vocab_size: int | None
    # Token ids that stand for media (placeholders, vision start/end): a prompt holding any of them
    # needs the processor.
    media_token_ids: frozenset[int]
    # The token that stands for an image (the processor's ``image_token_id``); None without images.
    image_token_id: int | None = None
    # The ids that stand for one media item's slots (image, video and audio placeholders): a prompt
    # holding one needs that item's media.
    placeholder_token_ids: frozenset[int] = frozenset()
    # One position's packed routed experts (engine/routing/shape.py): what routed_experts adds to a
    # result per token; 0 for a model without MoE layers.
    routed_bytes_per_token: int = 0

    def is_plain_text(self, token_ids: list[int]) -> bool:
        """True when these ids need no preprocessing: in the vocabulary and no media tokens."""
        if self.vocab_size is None:
            return False
        return all(0 <= t < self.vocab_size and t not in self.media_token_ids for t in token_ids)


_MEDIA_TOKEN_ATTRS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                      "image_token_index", "audio_token_id", "image_break_token_id", "image_end_token_id",
                      "video_token_index", "audio_token_index", "audio_start_token_id", "audio_end_token_id")


# The placeholder ids among them, as the engine names them (engine/loading.py's _media_token_ids).
_PLACEHOLDER_ATTRS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                      "audio_token_id", "audio_token_index")


def model_facts(model_path: str) -> ModelFacts:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text_config = getattr(config, "text_config", None) or config
    media = {getattr(c, name) for c in (config, text_config) for name in _MEDIA_TOKEN_ATTRS
             if isinstance(getattr(c, name, None), int)}
    image = next((getattr(c, name) for name in ("image_token_id", "image_token_index") for c in (config, text_config)
                  if isinstance(getattr(c, name, None), int)), None)
    placeholders = {getattr(c, name) for c in (config, text_config) for name in _PLACEHOLDER_ATTRS
                    if isinstance(getattr(c, name, None), int)}
    routing = routing_shape(config)
    return ModelFacts(getattr(text_config, "max_position_embeddings", None), getattr(text_config, "vocab_size", None),
                      frozenset(media), image, frozenset(placeholders),
                      routing.bytes_per_token if routing is not None else 0)
