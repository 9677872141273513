"""The demo model builder: deterministic, offline, and loadable through the normal HF path."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from engine.demo_model import ARCHS, IMAGE_ARCHS, MARKER, build_demo_model
from tests.engine.media_prompts import image_tokens


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _image_prompt(arch: str, config, tokenizer, features: dict) -> list[int]:
    text = tokenizer("Describe the image.", add_special_tokens=False)["input_ids"]
    return image_tokens(arch, config, tokenizer, features) + text


@pytest.mark.parametrize("arch", ARCHS)
def test_builds_are_byte_identical(tmp_path, arch):
    first = build_demo_model(tmp_path / "a", arch=arch)
    second = build_demo_model(tmp_path / "b", arch=arch)
    assert _digests(first) == _digests(second)
    assert (first / "model.safetensors").stat().st_size < 2_000_000


def test_complete_build_is_reused_and_incomplete_one_rebuilt(tmp_path):
    directory = build_demo_model(tmp_path / "m")
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert build_demo_model(directory) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp

    (directory / MARKER).unlink()  # as if a build had crashed before finishing
    build_demo_model(directory)
    assert (directory / MARKER).exists()
    with pytest.raises(ValueError, match="qwen2_vl"):
        build_demo_model(tmp_path / "x", arch="nope")


@pytest.mark.parametrize("arch", IMAGE_ARCHS)
def test_loads_through_from_pretrained_and_runs(tmp_path, arch):
    directory = build_demo_model(tmp_path / arch, arch=arch)
    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    image_processor = AutoImageProcessor.from_pretrained(directory)
    assert model.dtype == torch.float32
    assert model.config.text_config.vocab_size == len(tokenizer)

    features = dict(image_processor(images=[Image.new("RGB", (64, 48), (200, 30, 30))], return_tensors="pt"))
    if arch == "qwen2_vl":  # the field-note figures the rest of the tests rely on
        assert features["pixel_values"].shape == (16, 1176)
        assert features["image_grid_thw"].tolist() == [[1, 4, 4]]
    input_ids = torch.tensor([_image_prompt(arch, model.config, tokenizer, features)])
    if arch.startswith("qwen") and arch != "qwen2_5_omni":  # Omni's positions come from the ids alone
        features["mm_token_type_ids"] = (input_ids == model.config.image_token_id).long()
    with torch.no_grad():
        logits = model(input_ids=input_ids, **features).logits
    assert logits.shape == (1, input_ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()

    out = model.generate(input_ids=input_ids, **features, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, input_ids.shape[1] + 4)


def test_qwen_tokenizer_has_chat_template_and_specials(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_demo_model(tmp_path / "m"))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    assert "<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 1


def test_the_served_demo_takes_image_video_and_audio(tmp_path):
    from transformers import AutoConfig

    from engine.demo_model import SERVED_ARCH

    directory = build_demo_model(tmp_path / "served", arch=SERVED_ARCH)
    config = AutoConfig.from_pretrained(directory)
    assert config.architectures == ["Qwen2_5OmniThinkerForConditionalGeneration"]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert (tokenizer.image_token, tokenizer.video_token, tokenizer.audio_token) == ("<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "audio"},
                                      {"type": "text", "text": "hi"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    assert ("<|vision_bos|><|IMAGE|><|vision_eos|><|vision_bos|><|VIDEO|><|vision_eos|>"
            "<|audio_bos|><|AUDIO|><|audio_eos|>hi<|im_end|>") in text
