"""Pixtral-style LLaVA (a LLaVA checkpoint with a Pixtral vision tower): images keep their
aspect ratio, so the image processor pads a multi-image call to the largest size and bundles
the images in one ``pixel_values`` with their true ``image_sizes``. The model hook splits the
bundle per image and crops the padding away, so an image's features do not depend on which
other images it was processed with (cached and uncached features agree exactly).

Each image occupies rows of ``[IMG]`` tokens closed by ``[IMG_BREAK]``, the last by ``[IMG_END]``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.processing_utils import ProcessorMixin

from processors.base import Features, MultimodalProcessor
from processors.errors import InvalidFeaturesError, ItemLayoutError
from processors.hf_processors import PixtralImageOnlyProcessor
from processors.registration import register_processor


@register_processor("LlavaForConditionalGeneration", vision_model_type="pixtral")
class PixtralProcessor(MultimodalProcessor):
    native_image_placeholder = "[IMG]"
    feature_names = frozenset({"pixel_values", "image_sizes"})

    def load_hf_processor(self, model_dir: Path) -> ProcessorMixin:
        # transformers' PixtralProcessor module imports torchvision; this one does not.
        return PixtralImageOnlyProcessor.from_pretrained(model_dir)

    @property
    def placeholder_token_ids(self) -> frozenset[int]:
        return frozenset(self.hf.image_token_ids)

    @property
    def _step(self) -> int:
        return self.hf.patch_size * self.hf.spatial_merge_size

    def num_images(self, features: Features) -> int:
        return int(features["image_sizes"].shape[0])

    def split_features(self, features: Features) -> list[Features]:
        pixels, sizes = features["pixel_values"], features["image_sizes"]
        if pixels.shape[0] != sizes.shape[0]:
            raise ItemLayoutError(f"{pixels.shape[0]} images in pixel_values, {sizes.shape[0]} image_sizes")
        parts = []
        for i, (height, width) in enumerate(sizes.tolist()):
            if height > pixels.shape[-2] or width > pixels.shape[-1]:
                raise ItemLayoutError(f"image {i} of size {height}x{width} exceeds the padded bundle")
            # Crop the batch padding; contiguous so the part owns its memory (hash, transport).
            parts.append({
                "pixel_values": pixels[i:i + 1, :, :height, :width].contiguous(),
                "image_sizes": sizes[i:i + 1].clone(),
            })
        return parts

    def validate_features(self, features: Features) -> None:
        sizes, pixels = features["image_sizes"], features["pixel_values"]
        if sizes.dtype != torch.int64 or tuple(sizes.shape) != (1, 2):
            raise InvalidFeaturesError("image_sizes must be int64 of shape [1, 2] (one image per entry)")
        height, width = sizes[0].tolist()
        if height <= 0 or width <= 0 or height % self._step or width % self._step:
            raise InvalidFeaturesError(f"image_sizes {[height, width]} must be positive multiples of {self._step}")
        if not pixels.is_floating_point() or tuple(pixels.shape) != (1, 3, height, width):
            raise InvalidFeaturesError(f"pixel_values must be floating point of shape [1, 3, {height}, {width}]")
