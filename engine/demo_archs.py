"""The architectures :mod:`engine.demo_model` builds: each one's special tokens, chat template and
the configs of a tiny model of that family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni's thinker,
Qwen2-Audio, LLaVA, Pixtral), sized to build and run in milliseconds on a CPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ArchSpec:
    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    chat_template: str
    # Writes the model directory's configs (not the tokenizer, not the weights) and returns the
    # model class and config whose random weights the build saves.
    write: Callable[[Path, object, dict[str, int]], tuple[type, object]]
    # Named special tokens (tokenizer.image_token etc.), which some HF processors read.
    named: dict[str, str] | None = None
    # Added tokens that are not special (decoding keeps them), e.g. Qwen3's <think> and <tool_call>.
    added_tokens: tuple[str, ...] = ()



# --- Qwen-VL family ---------------------------------------------------------------------------

_QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2-VL's own chat template (images and videos as the native vision triple).
_QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _qwen_ids(ids: dict[str, int]) -> dict:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _qwen_text(tokenizer, ids: dict[str, int], **extra) -> dict:
    return {
        **_TEXT,
        "vocab_size": len(tokenizer),
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        **extra,
    }


def _save_qwen_image_processor(out: Path, patch_size: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    factor = patch_size * 2
    # min: one merged 2x2 block of patches; max: 256 tokens (a 448x448 image at patch 14).
    Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=2, temporal_patch_size=2,
        min_pixels=factor * factor, max_pixels=factor * factor * 256,
    ).save_pretrained(out)


def _write_qwen2_vl(out: Path, tokenizer, ids: dict[str, int]) -> tuple[type, object]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=_qwen_text(tokenizer, ids, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        **_qwen_ids(ids),
        architectures=["Qwen2VLForConditionalGeneration"],
        tie_word_embeddings=False,
    )
    _save_qwen_image_processor(out, 14)
    return Qwen2VLForConditionalGeneration, config


def _write_qwen2_5_vl(out: Path, tokenizer, ids: dict[str, int]) -> tuple[type, object]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=_qwen_text(tokenizer, ids, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]},
        **_qwen_ids(ids),
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        tie_word_embeddings=False,
    )
    _save_qwen_image_processor(out, 14)
    return Qwen2_5_VLForConditionalGeneration, config


def _write_qwen3_vl(out: Path, tokenizer, ids: dict[str, int]) -> tuple[type, object]:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=_qwen_text(tokenizer, ids, head_dim=16, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
            "mrope_interleaved": True}),
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 64,
                       "deepstack_visual_indexes": [1]},
        **_qwen_ids(ids),
        architectures=["Qwen3VLForConditionalGeneration"],
        tie_word_embeddings=False,
    )
    _save_qwen_image_processor(out, 16)
    return Qwen3VLForConditionalGeneration, config


# --- Qwen2.5-Omni thinker: image, video and audio ----------------------------------------------

_OMNI_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>",
)
_OMNI_NAMED = {
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
}
_OMNI_CHAT_TEMPLATE = (
    _QWEN_CHAT_TEMPLATE
    .replace("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_bos|><|IMAGE|><|vision_eos|>")
    .replace("<|vision_start|><|video_pad|><|vision_end|>", "<|vision_bos|><|VIDEO|><|vision_eos|>")
    .replace("{% elif 'text' in content %}",
             "{% elif content['type'] == 'audio' or 'audio' in content %}<|audio_bos|><|AUDIO|><|audio_eos|>"
             "{% elif 'text' in content %}")
)


def _write_qwen2_5_omni(out: Path, tokenizer, ids: dict[str, int]) -> tuple[type, object]:
    from transformers import (
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2_5OmniThinkerConfig(
        text_config=_qwen_text(tokenizer, ids, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]},
        audio_config={"num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2,
                      "encoder_ffn_dim": 64, "d_model": 32, "output_dim": 64, "n_window": 100},
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        user_token_id=ids["<|im_start|>"],
        # Read by the M-RoPE position code although the config class does not declare them.
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
        architectures=["Qwen2_5OmniThinkerForConditionalGeneration"],
        tie_word_embeddings=False,
    )
    factor = 28  # patch 14, merge 2; sizes as for the Qwen-VL demos
    image = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                     min_pixels=factor * factor, max_pixels=factor * factor * 256)
    # Written by hand: the HF processor class needs a torchvision video processor, and engine/ may
    # not import the video-less subclass in processors/. This is the file its save_pretrained writes.
    _write_processor_config(out, "Qwen2_5OmniProcessor", {
        "image_processor": image.to_dict(), "feature_extractor": WhisperFeatureExtractor(feature_size=128).to_dict()})
    return Qwen2_5OmniThinkerForConditionalGeneration, config


# --- Qwen2-Audio: audio only ----------------------------------------------------------------

_QWEN_AUDIO_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
_QWEN_AUDIO_NAMED = {"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}


def _write_qwen2_audio(out: Path, tokenizer, ids: dict[str, int]) -> tuple[type, object]:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor
    from transformers.models.qwen2_audio.processing_qwen2_audio import Qwen2AudioProcessor

    config = Qwen2AudioConfig(
        audio_config={"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "num_mel_bins": 128},
        text_config={**_qwen_text(tokenizer, ids), "model_type": "qwen2"},
        audio_token_index=ids["<|AUDIO|>"],
        architectures=["Qwen2AudioForConditionalGeneration"],
        tie_word_embeddings=False,
    )
    # Its stock processor needs no torchvision; save_pretrained writes tokenizer files again (same bytes).
    Qwen2AudioProcessor(WhisperFeatureExtractor(feature_size=128), tokenizer,
                        chat_template=tokenizer.chat_template).save_pretrained(out)
    return Qwen2AudioForConditionalGeneration, config


# --- LLaVA and Pixtral ------------------------------------------------------------------------

_LLAVA_SPECIALS = ("<unk>", "<s>", "</s>", "<image>")
_LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<image>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    # {{ '\n' }}: a literal newline right after a block tag is eaten by HF's trim_blocks.
    "{% if message['role'] == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

_PIXTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")
_PIXTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}[IMG]"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] if message['content'] is string else '' }}{% endif %}{% endfor %}"
)

_LLAMA_TEXT = {**_TEXT, "model_type": "llama", "head_dim": 16}


def _write_llava(out: Path, tokenizer, ids: dict[str, int]) -> tuple[type, object]:
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration

    image_size, patch = 56, 14  # 4x4 patches + CLS; the "default" strategy drops CLS: 16 tokens
    config = LlavaConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": image_size,
                       "patch_size": patch, "projection_dim": 32},
        text_config={**_LLAMA_TEXT, "vocab_size": len(tokenizer), "bos_token_id": ids["<s>"],
                     "eos_token_id": ids["</s>"], "pad_token_id": ids["<unk>"]},
        image_token_index=ids["<image>"],
        image_seq_length=(image_size // patch) ** 2,
        vision_feature_layer=-1,
        architectures=["LlavaForConditionalGeneration"],
        tie_word_embeddings=False,
    )
    CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
    ).save_pretrained(out)
    _write_processor_config(out, "LlavaProcessor", {
        "patch_size": patch, "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1, "image_token": "<image>"})
    return LlavaForConditionalGeneration, config


def _write_pixtral(out: Path, tokenizer, ids: dict[str, int]) -> tuple[type, object]:
    from transformers import LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    patch = 16
    config = LlavaConfig(
        vision_config={"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16,
                       "image_size": 1024, "patch_size": patch},
        text_config={**_LLAMA_TEXT, "vocab_size": len(tokenizer), "bos_token_id": ids["<s>"],
                     "eos_token_id": ids["</s>"], "pad_token_id": ids["<unk>"]},
        image_token_index=ids["[IMG]"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        spatial_merge_size=1,
        projector_hidden_act="gelu",
        multimodal_projector_bias=False,
        architectures=["LlavaForConditionalGeneration"],
        tie_word_embeddings=False,
    )
    PixtralImageProcessorPil(
        size={"longest_edge": 256}, patch_size={"height": patch, "width": patch},
    ).save_pretrained(out)
    _write_processor_config(out, "PixtralProcessor", {
        "patch_size": patch, "spatial_merge_size": 1, "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"})
    return LlavaForConditionalGeneration, config


def _write_processor_config(out: Path, processor_class: str, fields: dict) -> None:
    # LLaVA-style processors keep their own settings (patch size, token names) here.
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class, **fields}, sort_keys=True))


SPECS = {
    "qwen2_vl": ArchSpec(_QWEN_SPECIALS, None, "<|im_end|>", "<|endoftext|>", _QWEN_CHAT_TEMPLATE, _write_qwen2_vl),
    "qwen2_5_vl": ArchSpec(_QWEN_SPECIALS, None, "<|im_end|>", "<|endoftext|>", _QWEN_CHAT_TEMPLATE,
                        _write_qwen2_5_vl),
    "qwen3_vl": ArchSpec(_QWEN_SPECIALS, None, "<|im_end|>", "<|endoftext|>", _QWEN_CHAT_TEMPLATE, _write_qwen3_vl),
    "llava": ArchSpec(_LLAVA_SPECIALS, "<s>", "</s>", "<unk>", _LLAVA_CHAT_TEMPLATE, _write_llava),
    "qwen2_5_omni": ArchSpec(_OMNI_SPECIALS, None, "<|im_end|>", "<|endoftext|>", _OMNI_CHAT_TEMPLATE,
                          _write_qwen2_5_omni, _OMNI_NAMED),
    "qwen2_audio": ArchSpec(_QWEN_AUDIO_SPECIALS, None, "<|im_end|>", "<|endoftext|>", _OMNI_CHAT_TEMPLATE,
                         _write_qwen2_audio, _QWEN_AUDIO_NAMED),
    "pixtral": ArchSpec(_PIXTRAL_SPECIALS, "<s>", "</s>", "<unk>", _PIXTRAL_CHAT_TEMPLATE, _write_pixtral),
}
