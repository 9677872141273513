"""Qwen2-Audio: audio only, with its stock HF processor (it needs no torchvision).

Audio as ``processors.whisper_audio`` describes: ``<|AUDIO|>`` runs inside
``<|audio_bos|> ... <|audio_eos|>``. It takes no images, so it has no image placeholder.
"""

from __future__ import annotations

from processors.base import MultimodalProcessor
from processors.registration import register_processor
from processors.whisper_audio import WhisperAudioMixin


@register_processor("Qwen2AudioForConditionalGeneration")
class Qwen2AudioProcessor(WhisperAudioMixin, MultimodalProcessor):
    modalities = frozenset({"audio"})
    native_placeholders = {"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"}
    feature_names = frozenset()  # precomputed features are for images, which it does not take
