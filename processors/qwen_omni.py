"""Qwen2.5-Omni (its thinker): image, video and audio in one model.

Images and video as Qwen2.5-VL's, with Omni's own tokens (``<|IMAGE|>``, ``<|VIDEO|>`` inside
``<|vision_bos|> ... <|vision_eos|>``) and ``video_second_per_grid``. Audio goes through Whisper's
feature extractor, padded to its 30 s window (``input_features`` (1, 128, 3000) and a
``feature_attention_mask`` marking the real frames; padding to the longest clip instead changes
the logits), and takes ``(((frames - 1) // 2 + 1) - 2) // 2 + 1`` ``<|AUDIO|>`` tokens inside
``<|audio_bos|> ... <|audio_eos|>``: 25 per second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from processors.base import Features
from processors.fetch.errors import MediaTooLargeError
from processors.hf_processors import Qwen2_5OmniProcessorNoVideo
from processors.qwen_vl import _QwenVideoMixin, _QwenVLProcessor
from processors.registry import register_processor


def audio_token_count(frames: int) -> int:
    """Tokens the audio encoder makes of ``frames`` mel frames (two stride-2 steps)."""
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


class _WhisperAudioMixin:
    """Audio through ``hf.feature_extractor`` (a WhisperFeatureExtractor), max-length padded."""

    audio_pad = "<|AUDIO|>"

    @cached_property
    def audio_token_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(self.audio_pad))

    def process(self, modality: str, media: Sequence[Any], options: Mapping[str, Any]) -> Features:
        if modality != "audio":
            return super().process(modality, media, options)
        extractor = self.hf.feature_extractor
        window = extractor.n_samples / extractor.sampling_rate
        for audio in media:
            if len(audio.samples) > extractor.n_samples:
                raise MediaTooLargeError(f"the audio is longer than the model's {window:g} s window")
        out = extractor([np.asarray(a.samples) for a in media], sampling_rate=extractor.sampling_rate,
                        return_attention_mask=True, padding="max_length", return_tensors="pt")
        return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}

    def split(self, modality: str, features: Features) -> list[Features]:
        if modality != "audio":
            return super().split(modality, features)
        count = features["input_features"].shape[0]
        return [{name: tensor[i:i + 1] for name, tensor in features.items()} for i in range(count)]

    def replacement(self, modality: str, features: Features, index: int) -> list[int]:
        if modality != "audio":
            return super().replacement(modality, features, index)
        frames = int(features["feature_attention_mask"][index].sum())
        return [self.audio_token_id] * audio_token_count(frames)

    def token_id(self, modality: str) -> int:
        return self.audio_token_id if modality == "audio" else super().token_id(modality)


@register_processor("Qwen2_5OmniThinkerForConditionalGeneration")
class Qwen2_5OmniProcessor(_WhisperAudioMixin, _QwenVideoMixin, _QwenVLProcessor):
    modalities = frozenset({"image", "video", "audio"})
    native_image_placeholder = "<|vision_bos|><|IMAGE|><|vision_eos|>"
    native_placeholders = {
        "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
        "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
    }
    video_pad = "<|VIDEO|>"
    seconds_name = "video_second_per_grid"
    hf_class = Qwen2_5OmniProcessorNoVideo
