"""The multimodal processor interface: one small class per model family.

A processor wraps the model's Hugging Face processor and answers the few model-specific
questions the pipeline asks: how images become features, which token run each image occupies in
the prompt, how a bundle of features splits per image, and what precomputed features must look
like. Everything else (fetching, caching, placeholder matching, finalizing) lives in the pipeline
and is the same for every model.

Subclasses set the class attributes and override a hook only where its docstring says so.
The constructor loads the HF processor and nothing else: no environment reads, no pools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image
from transformers import AutoProcessor, PretrainedConfig
from transformers.processing_utils import ProcessorMixin

from processors.errors import ItemLayoutError
from processors.fetch.errors import MediaDecodeError
from processors.placeholders import normalize_text, sentinel_pattern

Features = dict[str, torch.Tensor]


class MultimodalProcessor:
    #: Modalities the model takes (video is left out where it needs torchvision).
    modalities: ClassVar[frozenset[str]] = frozenset({"image"})
    #: An image's placeholder as the model's chat template writes it (collapsed).
    native_image_placeholder: ClassVar[str]
    #: Feature names one image has, exactly (validated for precomputed features).
    feature_names: ClassVar[frozenset[str]] = frozenset({"pixel_values"})
    #: Longest side over shortest side an image may have. Qwen-VL's resize refuses past 200, and
    #: shortest-edge resizers (CLIP, LLaVA) would blow a thin strip up to billions of pixels.
    max_aspect_ratio: ClassVar[float] = 200.0

    def __init__(self, model_dir: str | Path, *, config: PretrainedConfig, model_id: str | None = None):
        self.model_dir = Path(model_dir)
        self.config = config
        # Part of every cache key: features of two models never mix.
        self.model_id = model_id or f"{type(self).__name__}:{self.model_dir.resolve()}"
        self.hf: ProcessorMixin = self.load_hf_processor(self.model_dir)

    @property
    def tokenizer(self):
        return self.hf.tokenizer

    # --- hooks -----------------------------------------------------------------------------

    def load_hf_processor(self, model_dir: Path) -> ProcessorMixin:
        """Load the HF processor. Override when ``AutoProcessor`` cannot build it as is
        (e.g. its stock class needs torchvision)."""
        return AutoProcessor.from_pretrained(model_dir)

    def process_images(self, images: Sequence[Image.Image], options: Mapping[str, Any]) -> Features:
        """Run the HF image processor over ``images`` in one call; the result may bundle them.
        Override only if the model's image processor needs different arguments."""
        return dict(self.hf.image_processor(images=list(images), return_tensors="pt", **options))

    def num_images(self, features: Features) -> int:
        """How many images a feature bundle holds. Default: one ``pixel_values`` row each.
        Override when images are flattened into patches (Qwen-VL)."""
        return int(features["pixel_values"].shape[0])

    def split_features(self, features: Features) -> list[Features]:
        """The model hook of finalize: split a bundle into one feature dict per image, while the
        features are real tensors. Default: every feature has one row per image along dim 0.
        Override when images share rows (patches) or are padded to a common size."""
        count = self.num_images(features)
        for name, tensor in features.items():
            if tensor.shape[0] != count:
                raise ItemLayoutError(f"{name} has {tensor.shape[0]} rows for {count} images")
        return [{name: tensor[i:i + 1] for name, tensor in features.items()} for i in range(count)]

    def replacement_ids(self, features: Features, index: int) -> list[int]:
        """The token ids image ``index`` of ``features`` occupies in the expanded prompt.
        Default: the HF processor's own replacement, so both paths expand alike; override only
        if the HF processor has no ``replace_image_token``."""
        text = self.hf.replace_image_token(features, image_idx=index)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def check_image(self, image: Image.Image) -> None:
        """Refuse a decoded image the model's processor cannot take, before it runs. Override to
        add limits; raise :class:`~processors.fetch.errors.MediaDecodeError`."""
        width, height = image.size
        if max(width, height) > self.max_aspect_ratio * min(width, height):
            raise MediaDecodeError(f"the image is {width}x{height}: this model takes aspect ratios up to "
                                   f"{self.max_aspect_ratio:g}:1")

    def validate_features(self, features: Features) -> None:
        """Check one image's precomputed features beyond names, dtypes and sizes (which the
        pipeline checks): shapes that agree with each other and with the model. Override per
        model; raise :class:`InvalidFeaturesError`."""

    # --- derived, the same for every model ---------------------------------------------------

    @cached_property
    def image_token_id(self) -> int:
        """The token that stands for a whole image when collapsed, and fills expanded runs."""
        return int(self.hf.image_token_id)

    @cached_property
    def placeholder_token_ids(self) -> frozenset[int]:
        """Token ids an expanded image run is made of."""
        return frozenset({self.image_token_id})

    @cached_property
    def _sentinel_pattern(self):
        return sentinel_pattern(self.native_image_placeholder)

    def normalize_prompt(self, prompt: str) -> tuple[str, int]:
        """``prompt`` with ``<image>`` sentinels in native form, and how many images it marks."""
        return normalize_text(prompt, self._sentinel_pattern, self.native_image_placeholder)

    def embed_token_count(self, replacement: Sequence[int]) -> int:
        """How many feature rows the model consumes for an image with this replacement run."""
        return sum(1 for token in replacement if token == self.image_token_id)
