"""The multimodal processor interface: one small class per model family.

A processor wraps the model's Hugging Face processor and answers the few model-specific
questions the pipeline asks: how images become features, which token run each image occupies in
the prompt, how a bundle of features splits per image, and what precomputed features must look
like. Everything else (fetching, decoding, caching, placeholder matching, finalizing) lives in the
pipeline and is the same for every model.

The pipeline asks per modality (:meth:`process`, :meth:`split`, :meth:`replacement`,
:meth:`token_id`); for images these call the image hooks below, and a model that takes video or
audio overrides them for those modalities and leaves images to ``super()``.

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

from processors.errors import ItemLayoutError, UnsupportedModalityError
from processors.fetch.errors import MediaDecodeError
from processors.placeholders import SENTINELS, media_pattern, normalize_media

Features = dict[str, torch.Tensor]


class MultimodalProcessor:
    #: Modalities the model takes (video is left out where it needs torchvision).
    modalities: ClassVar[frozenset[str]] = frozenset({"image"})
    #: An image's placeholder as the model's chat template writes it (collapsed).
    native_image_placeholder: ClassVar[str]
    #: The other modalities' placeholders as the chat template writes them, e.g. {"video": ...}.
    native_placeholders: ClassVar[Mapping[str, str]] = {}
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

    # --- per modality: images go to the image hooks; override for video and audio ------------

    def process(self, modality: str, media: Sequence[Any], options: Mapping[str, Any]) -> Features:
        """Features of every freshly decoded item of ``modality`` in one call (may bundle them):
        images are Pillow images, videos :class:`~processors.decode.DecodedVideo`, audio
        :class:`~processors.decode.DecodedAudio`."""
        if modality != "image":
            raise self._unsupported(modality)
        return self.process_images(media, options)

    def split(self, modality: str, features: Features) -> list[Features]:
        """The model hook of finalize for ``modality``: one feature dict per item."""
        if modality != "image":
            raise self._unsupported(modality)
        return self.split_features(features)

    def replacement(self, modality: str, features: Features, index: int) -> list[int]:
        """The token run item ``index`` of a ``modality`` bundle occupies in the expanded prompt."""
        if modality != "image":
            raise self._unsupported(modality)
        return self.replacement_ids(features, index)

    def token_id(self, modality: str) -> int:
        """The collapsed placeholder token of ``modality`` (it also fills expanded runs)."""
        if modality != "image":
            raise self._unsupported(modality)
        return self.image_token_id

    def native_placeholder(self, modality: str) -> str:
        return self.native_image_placeholder if modality == "image" else self.native_placeholders[modality]

    def _unsupported(self, modality: str) -> UnsupportedModalityError:
        return UnsupportedModalityError(
            f"this model takes {', '.join(sorted(self.modalities))}, not {modality}"
        )

    # --- derived, the same for every model ---------------------------------------------------

    @cached_property
    def audio_sample_rate(self) -> int | None:
        """The sample rate the feature extractor takes (audio is resampled to it); None without one."""
        extractor = getattr(self.hf, "feature_extractor", None)
        return getattr(extractor, "sampling_rate", None)

    @cached_property
    def image_token_id(self) -> int:
        """The token that stands for a whole image when collapsed, and fills expanded runs."""
        return int(self.hf.image_token_id)

    @cached_property
    def placeholder_token_ids(self) -> frozenset[int]:
        """Token ids an expanded image run is made of."""
        return frozenset({self.image_token_id})

    @cached_property
    def media_placeholder_ids(self) -> frozenset[int]:
        """Token ids the expanded runs of every modality are made of."""
        others = {self.token_id(m) for m in self.modalities if m != "image"}
        return (self.placeholder_token_ids if "image" in self.modalities else frozenset()) | others

    @cached_property
    def token_modality(self) -> dict[int, str]:
        """The modality of every placeholder token id."""
        others = {self.token_id(m): m for m in self.modalities if m != "image"}
        images = self.placeholder_token_ids if "image" in self.modalities else ()
        return {**dict.fromkeys(images, "image"), **others}

    @cached_property
    def _forms(self) -> dict[str, str]:
        """Every marker a text prompt may use (sentinel or native form) -> its native form."""
        forms = {}
        for modality in sorted(self.modalities):
            native = self.native_placeholder(modality)
            forms[SENTINELS[modality]] = native
            forms[native] = native
        return forms

    @cached_property
    def _sentinel_pattern(self):
        return media_pattern(self._forms)

    def normalize_prompt(self, prompt: str) -> tuple[str, int]:
        """``prompt`` with ``<image>``/``<video>``/``<audio>`` sentinels (of the modalities the
        model takes) in native form, and how many media items it marks."""
        return normalize_media(prompt, self._sentinel_pattern, self._forms)

    def embed_token_count(self, replacement: Sequence[int]) -> int:
        """How many feature rows the model consumes for an image with this replacement run."""
        return sum(1 for token in replacement if token == self.image_token_id)
