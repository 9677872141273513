"""Qwen2.5-Omni (its thinker): image, video and audio in one model.

Images and video as Qwen2.5-VL's, with Omni's own tokens (``<|IMAGE|>``, ``<|VIDEO|>`` inside
``<|vision_bos|> ... <|vision_eos|>``) and ``video_second_per_grid``; audio as
``processors.whisper_audio`` describes, ``<|AUDIO|>`` runs inside ``<|audio_bos|> ... <|audio_eos|>``.
"""

from __future__ import annotations

from processors.hf_processors import Qwen2_5OmniProcessorNoVideo
from processors.qwen_vl import _QwenVideoMixin, _QwenVLProcessor
from processors.registration import register_processor
from processors.whisper_audio import WhisperAudioMixin


@register_processor("Qwen2_5OmniThinkerForConditionalGeneration")
class Qwen2_5OmniProcessor(WhisperAudioMixin, _QwenVideoMixin, _QwenVLProcessor):
    modalities = frozenset({"image", "video", "audio"})
    native_image_placeholder = "<|vision_bos|><|IMAGE|><|vision_eos|>"
    native_placeholders = {
        "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
        "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
    }
    video_pad = "<|VIDEO|>"
    seconds_name = "video_second_per_grid"
    hf_class = Qwen2_5OmniProcessorNoVideo
