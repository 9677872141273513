"""The processor registry itself: architecture name -> processor class.

A processor class registers the names in ``config.architectures`` it serves::

    @register_processor("Qwen2VLForConditionalGeneration")
    class Qwen2VLProcessor(MultimodalProcessor): ...

Architectures shared by several vision towers (LLaVA checkpoints with a Pixtral tower) register
with ``vision_model_type=`` and win over the plain entry for that tower. Registering a name twice
raises. The processor modules import this module; ``processors.registry`` imports them, so the
registry is filled whenever anything loads a processor (and nothing imports in a circle).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import AutoConfig

from processors.base import MultimodalProcessor
from processors.errors import UnsupportedModelError

_Key = tuple[str, str | None]


class ProcessorRegistry:
    def __init__(self) -> None:
        self._classes: dict[_Key, type[MultimodalProcessor]] = {}

    def register(
        self, *architectures: str, vision_model_type: str | None = None
    ) -> Callable[[type[MultimodalProcessor]], type[MultimodalProcessor]]:
        """Class decorator: serve ``architectures`` (optionally only with that vision tower)."""
        if not architectures:
            raise ValueError("register at least one architecture name")

        def decorator(cls: type[MultimodalProcessor]) -> type[MultimodalProcessor]:
            for architecture in architectures:
                key = (architecture, vision_model_type)
                if key in self._classes:
                    raise ValueError(
                        f"{_describe(key)} is already registered to {self._classes[key].__qualname__}"
                    )
                self._classes[key] = cls
            return cls

        return decorator

    def supported(self) -> list[str]:
        return sorted(_describe(key) for key in self._classes)

    def processor_class(self, architecture: str | None, vision_model_type: str | None = None):
        for key in ((architecture, vision_model_type), (architecture, None)):
            if architecture is not None and key in self._classes:
                return self._classes[key]
        raise UnsupportedModelError(
            f"no multimodal processor for architecture {architecture!r}"
            f"{f' with a {vision_model_type!r} vision tower' if vision_model_type else ''}; "
            f"supported: {', '.join(self.supported())}",
            architecture=architecture,
            supported=self.supported(),
        )

    def load(self, model_dir: str | Path, *, model_id: str | None = None) -> MultimodalProcessor:
        config = AutoConfig.from_pretrained(model_dir)
        architecture = (config.architectures or [None])[0]
        vision = getattr(getattr(config, "vision_config", None), "model_type", None)
        cls = self.processor_class(architecture, vision)
        return cls(model_dir, config=config, model_id=model_id)


def _describe(key: _Key) -> str:
    architecture, vision = key
    return f"{architecture} (vision: {vision})" if vision else architecture


REGISTRY = ProcessorRegistry()
register_processor = REGISTRY.register
