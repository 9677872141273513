"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: images as flattened patches with a (t, h, w) grid.

The image processor concatenates every image's patches into one ``pixel_values`` and lists the
grids in ``image_grid_thw``; an image takes ``t*h*w / merge**2`` ``<|image_pad|>`` tokens inside
``<|vision_start|> ... <|vision_end|>``. Qwen2-VL and Qwen2.5-VL also take video, built from the
image processor (``processors.qwen_video``: the stock video processors need torchvision): a video
takes ``t*h*w / merge**2`` ``<|video_pad|>`` tokens in the same frame, with
``pixel_values_videos``, ``video_grid_thw`` and, for Qwen2.5-VL, ``second_per_grid_ts``. Qwen3-VL
video is left out: its prompt interleaves per-frame timestamps as text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from transformers.processing_utils import ProcessorMixin

from processors.base import Features, MultimodalProcessor
from processors.errors import InvalidFeaturesError, ItemLayoutError
from processors.hf_processors import (
    Qwen2_5_VLImageProcessorOnly,
    Qwen2VLImageProcessorOnly,
    Qwen3VLImageProcessorOnly,
)
from processors.qwen_video import qwen_video_features, seconds_per_grid, split_by_grid, video_size
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


class _QwenVideoMixin:
    """Video for Qwen-VL processors (``hf.image_processor`` a Qwen2-VL one): frames paired into
    temporal patches, ``<|video_pad|>`` runs. ``seconds_name`` is the model's name for the
    seconds one temporal patch spans (None: the model does not take it)."""

    native_placeholders = {"video": "<|vision_start|><|video_pad|><|vision_end|>"}
    video_pad = "<|video_pad|>"
    seconds_name: str | None = None

    @cached_property
    def _video_size(self) -> dict[str, int] | None:
        return video_size(self.model_dir)

    @cached_property
    def video_token_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(self.video_pad))

    def process(self, modality: str, media: Sequence[Any], options: Mapping[str, Any]) -> Features:
        if modality != "video":
            return super().process(modality, media, options)
        image = self.hf.image_processor
        features = qwen_video_features(image, media, options, self._video_size)
        if self.seconds_name:
            features[self.seconds_name] = seconds_per_grid(image, media)
        return features

    def split(self, modality: str, features: Features) -> list[Features]:
        if modality != "video":
            return super().split(modality, features)
        per_item = [self.seconds_name] if self.seconds_name else []
        return split_by_grid(features, "pixel_values_videos", "video_grid_thw", per_item)

    def replacement(self, modality: str, features: Features, index: int) -> list[int]:
        if modality != "video":
            return super().replacement(modality, features, index)
        count = int(features["video_grid_thw"][index].prod()) // self.hf.image_processor.merge_size**2
        return [self.video_token_id] * count

    def token_id(self, modality: str) -> int:
        return self.video_token_id if modality == "video" else super().token_id(modality)


@register_processor("Qwen2VLForConditionalGeneration")
class Qwen2VLProcessor(_QwenVideoMixin, _QwenVLProcessor):
    modalities = frozenset({"image", "video"})
    hf_class = Qwen2VLImageProcessorOnly


@register_processor("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5_VLProcessor(_QwenVideoMixin, _QwenVLProcessor):
    modalities = frozenset({"image", "video"})
    hf_class = Qwen2_5_VLImageProcessorOnly
    seconds_name = "second_per_grid_ts"


@register_processor("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
class Qwen3VLProcessor(_QwenVLProcessor):
    hf_class = Qwen3VLImageProcessorOnly
