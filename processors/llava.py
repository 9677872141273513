"""LLaVA (CLIP-style vision tower): one fixed-size ``pixel_values`` row per image, a fixed run
of ``<image>`` tokens each. The stock ``LlavaProcessor`` works without torchvision."""

from __future__ import annotations

from processors.base import Features, MultimodalProcessor
from processors.errors import InvalidFeaturesError
from processors.registration import register_processor


@register_processor("LlavaForConditionalGeneration")
class LlavaProcessor(MultimodalProcessor):
    native_image_placeholder = "<image>"
    feature_names = frozenset({"pixel_values"})

    def validate_features(self, features: Features) -> None:
        crop = self.hf.image_processor.crop_size
        expected = (1, 3, crop["height"], crop["width"])
        pixels = features["pixel_values"]
        if not pixels.is_floating_point() or tuple(pixels.shape) != expected:
            raise InvalidFeaturesError(f"pixel_values must be floating point of shape {list(expected)}")
