"""Engine fixtures: the demo Qwen2-VL loaded once per session, prompts and image features."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def loaded(demo_model_dir):
    from engine.loading import load_model

    return load_model(str(demo_model_dir), device="cpu")


@pytest.fixture(scope="session")
def engine(loaded):
    from engine.generation import Engine

    return Engine(loaded)


@pytest.fixture(scope="session")
def prompts(demo_model_dir, loaded):
    return Prompts(demo_model_dir, loaded)


class Prompts:
    """Real token ids from the demo tokenizer, and image prompts built from the image processor."""

    def __init__(self, directory: Path, loaded):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.image_processor = AutoImageProcessor.from_pretrained(directory)
        self.config = loaded.model.config

    def text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def image_features(self, size=(64, 48), color="red") -> dict[str, torch.Tensor]:
        image = Image.new("RGB", size, color)
        out = self.image_processor(images=[image], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def image_tokens(self, features) -> list[int]:
        merge = self.config.vision_config.spatial_merge_size
        n = int(features["image_grid_thw"].prod()) // merge**2
        c = self.config
        return [c.vision_start_token_id, *[c.image_token_id] * n, c.vision_end_token_id]

    def image_prompt(self, text: str, features) -> list[int]:
        return self.text("User: ") + self.image_tokens(features) + self.text(text)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(arch)``: a tiny real model of ``arch`` ("text" for a text-only one), built once per module."""
    from tests.engine.scheduler_models import model_builder

    return model_builder(tmp_path_factory)
