"""Which processor serves which model: ``load_processor`` picks it by HF architecture name.

The registry (``processors.registration``) is filled by the processor modules imported here,
explicitly: an ImportError there is a broken install and propagates, it is never logged and
skipped.
"""

from __future__ import annotations

from pathlib import Path

from processors import llava, pixtral, qwen_audio, qwen_omni, qwen_vl, text_only  # noqa: F401  (each registers its classes)
from processors.base import MultimodalProcessor
from processors.registration import REGISTRY, ProcessorRegistry, register_processor

__all__ = ["REGISTRY", "ProcessorRegistry", "load_processor", "register_processor", "supported_architectures"]

supported_architectures = REGISTRY.supported


def load_processor(model_dir: str | Path, *, model_id: str | None = None) -> MultimodalProcessor:
    """The processor for the model in ``model_dir``, chosen by ``config.architectures[0]``."""
    return REGISTRY.load(model_dir, model_id=model_id)
