"""Tiny real models for the scheduler's tests (one per architecture, built once per module that
uses the ``models`` fixture of tests/engine/conftest.py), with prompts built from their own
tokenizer and image processor."""

from __future__ import annotations

import torch
from PIL import Image

from engine.capacity import SchedulerLimits
from engine.demo_model import build_demo_model
from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams
from tests.engine.media_prompts import image_tokens


class Model:
    """One architecture: its engine, tokenizer and image processor, and prompts built from them."""

    def __init__(self, arch: str, directory):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.arch = arch
        self.loaded = load_model(str(directory), device="cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.image_processor = AutoImageProcessor.from_pretrained(directory) if arch != "text" else None

    def engine(self, **limits) -> Engine:
        return Engine(self.loaded, SchedulerLimits(**limits))

    def text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def image(self, size=(64, 48), color="red") -> dict[str, torch.Tensor]:
        out = self.image_processor(images=[Image.new("RGB", size, color)], return_tensors="pt")
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    def request(self, text: str, params: SamplingParams, image=None) -> GenerationRequest:
        if image is None:
            return GenerationRequest(self.text(text), params)
        ids = image_tokens(self.arch, self.loaded.model.config, self.tokenizer, image) + self.text(text)
        return GenerationRequest(ids, params, mm_kwargs=image)


def _text_only_model(directory, tokenizer_dir):
    """A tiny random Qwen2ForCausalLM (a text-only model) with the demo tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(directory)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).eval().save_pretrained(directory)
    return directory


def model_builder(tmp_path_factory):
    root = tmp_path_factory.mktemp("scheduler-models")
    cache = {}

    def get(arch: str) -> Model:
        if arch not in cache:
            if arch == "text":
                directory = _text_only_model(root / arch, build_demo_model(root / "qwen2_vl"))
            else:
                directory = build_demo_model(root / arch, arch=arch)
            cache[arch] = Model(arch, directory)
        return cache[arch]

    return get
