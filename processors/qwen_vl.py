"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: images as flattened patches with a (t, h, w) grid.

The image processor concatenates every image's patches into one ``pixel_values`` and lists the
grids in ``image_grid_thw``; an image takes ``t*h*w / merge**2`` ``<|image_pad|>`` tokens inside
``<|vision_start|> ... <|vision_end|>``. Video is left out: the Qwen video processors need
torchvision, which this deployment does not have.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.processing_utils import ProcessorMixin

from processors.base import Features, MultimodalProcessor
from processors.errors import InvalidFeaturesError, ItemLayoutError
from processors.hf_processors import (
    Qwen2_5_VLImageProcessorOnly,
    Qwen2VLImageProcessorOnly,
    Qwen3VLImageProcessorOnly,
)
from processors.registration import register_processor


class _QwenVLProcessor(MultimodalProcessor):
    native_image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    feature_names = frozenset({"pixel_values", "image_grid_thw"})
    hf_class: type[ProcessorMixin]

    def load_hf_processor(self, model_dir: Path) -> ProcessorMixin:
        # The stock processor wants a torchvision video processor; ours is image-only.
        return self.hf_class.from_pretrained(model_dir)

    def num_images(self, features: Features) -> int:
        return int(features["image_grid_thw"].shape[0])

    def replacement_ids(self, features: Features, index: int) -> list[int]:
        # HF's replace_image_token formula (t*h*w / merge**2 pads) without tokenizing a string of
        # up to thousands of pads on every call; the contract test checks both agree.
        count = int(features["image_grid_thw"][index].prod()) // self.hf.image_processor.merge_size**2
        return [self.image_token_id] * count

    def split_features(self, features: Features) -> list[Features]:
        grids = features["image_grid_thw"]
        rows = grids.prod(dim=-1).tolist()
        pixels = features["pixel_values"]
        if pixels.shape[0] != sum(rows):
            raise ItemLayoutError(f"pixel_values has {pixels.shape[0]} patch rows, the grids need {sum(rows)}")
        return [
            {"pixel_values": part, "image_grid_thw": grids[i:i + 1]}
            for i, part in enumerate(pixels.split(rows, dim=0))
        ]

    def validate_features(self, features: Features) -> None:
        image = self.hf.image_processor
        grid, pixels = features["image_grid_thw"], features["pixel_values"]
        if grid.dtype != torch.int64 or tuple(grid.shape) != (1, 3):
            raise InvalidFeaturesError("image_grid_thw must be int64 of shape [1, 3] (one image per entry)")
        t, h, w = grid[0].tolist()
        if t != 1 or h <= 0 or w <= 0 or h % image.merge_size or w % image.merge_size:
            raise InvalidFeaturesError(
                f"image_grid_thw {[t, h, w]} is not an image grid (t=1, h and w multiples of {image.merge_size})"
            )
        width = 3 * image.temporal_patch_size * image.patch_size**2
        if not pixels.is_floating_point() or tuple(pixels.shape) != (t * h * w, width):
            raise InvalidFeaturesError(f"pixel_values must be floating point of shape [{t * h * w}, {width}]")


@register_processor("Qwen2VLForConditionalGeneration")
class Qwen2VLProcessor(_QwenVLProcessor):
    hf_class = Qwen2VLImageProcessorOnly


@register_processor("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5_VLProcessor(_QwenVLProcessor):
    hf_class = Qwen2_5_VLImageProcessorOnly


@register_processor("Qwen3VLForConditionalGeneration")
class Qwen3VLProcessor(_QwenVLProcessor):
    hf_class = Qwen3VLImageProcessorOnly
