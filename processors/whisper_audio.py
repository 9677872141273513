"""Audio through a Whisper feature extractor (Qwen2-Audio, Qwen2.5-Omni).

The extractor is numpy (no torchaudio) and pads every clip to its 30 s window: ``input_features``
(1, 128, 3000) and a ``feature_attention_mask`` marking the real frames (padding to the longest
clip instead changes the logits; Qwen2-Audio's encoder needs exactly 3000 frames). A clip takes
``(((frames - 1) // 2 + 1) - 2) // 2 + 1`` audio tokens: 25 per second. A clip longer than the
window is refused rather than cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from processors.base import Features
from processors.fetch.errors import MediaTooLargeError


def audio_token_count(frames: int) -> int:
    """Tokens the audio encoder makes of ``frames`` mel frames (two stride-2 steps)."""
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


class WhisperAudioMixin:
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
