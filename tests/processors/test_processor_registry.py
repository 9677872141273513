"""The processor registry: keyed by architecture, strict about duplicates and unknown names,
and importing its processor modules explicitly."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import processors.base
import processors.llava
import processors.pixtral
import processors.qwen_vl
from engine.errors import Fault
from processors.base import MultimodalProcessor
from processors.errors import UnsupportedModelError
from processors.registry import ProcessorRegistry, load_processor, supported_architectures

ROOT = Path(__file__).resolve().parents[2]


def test_registering_a_name_twice_raises():
    registry = ProcessorRegistry()

    @registry.register("FooForConditionalGeneration")
    class Foo(MultimodalProcessor):
        pass

    with pytest.raises(ValueError, match="already registered to .*Foo"):
        registry.register("FooForConditionalGeneration")(type("Bar", (MultimodalProcessor,), {}))
    # The same name with a specific vision tower is another entry, preferred for that tower.
    special = registry.register("FooForConditionalGeneration", vision_model_type="siglip")(
        type("Special", (MultimodalProcessor,), {}))
    assert registry.processor_class("FooForConditionalGeneration", "siglip") is special
    assert registry.processor_class("FooForConditionalGeneration", "clip") is Foo
    with pytest.raises(ValueError):
        registry.register()


def test_unknown_architecture_lists_the_supported_ones(model_dirs, tmp_path):
    with pytest.raises(UnsupportedModelError) as caught:
        ProcessorRegistry().processor_class("GPT2LMHeadModel")
    assert caught.value.supported == [] and caught.value.architecture == "GPT2LMHeadModel"

    model = shutil.copytree(model_dirs["qwen2_vl"], tmp_path / "renamed")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["MysteryForConditionalGeneration"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as caught:
        load_processor(model)
    assert caught.value.code == "unsupported_model" and caught.value.fault is Fault.INTERNAL
    assert caught.value.supported == supported_architectures()
    for name in supported_architectures():
        assert name in caught.value.message


def test_load_processor_picks_by_architecture_and_vision_tower(model_dirs):
    expected = {
        "qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
        "llava": "LlavaProcessor", "pixtral": "PixtralProcessor",  # both LlavaForConditionalGeneration
        "qwen2_5_omni": "Qwen2_5OmniProcessor", "qwen2_audio": "Qwen2AudioProcessor",
        "qwen3_tools": "Qwen3VLProcessor", "qwen3_moe": "TextOnlyProcessor",
        "qwen3_vl_moe": "Qwen3VLProcessor",
    }
    for arch, directory in model_dirs.items():
        processor = load_processor(directory, model_id=f"demo/{arch}")
        assert type(processor).__name__ == expected[arch]
        assert processor.model_id == f"demo/{arch}"


def test_image_only_qwen_processors_load_through_auto_processor(model_dirs):
    from transformers import AutoProcessor

    from processors.hf_processors import (
        Qwen2_5_VLImageProcessorOnly,
        Qwen2VLImageProcessorOnly,
        Qwen3VLImageProcessorOnly,
    )

    for arch, cls in (("qwen2_vl", Qwen2VLImageProcessorOnly), ("qwen2_5_vl", Qwen2_5_VLImageProcessorOnly),
                      ("qwen3_vl", Qwen3VLImageProcessorOnly)):
        processor = AutoProcessor.from_pretrained(model_dirs[arch])
        assert type(processor) is cls and not hasattr(processor, "video_processor")


def test_a_broken_processor_module_fails_the_import():
    # A processor module that cannot import must stop the registry import, never be skipped.
    code = "import sys; sys.modules['processors.pixtral'] = None; import processors.registry"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "ModuleNotFoundError: import of processors.pixtral halted" in result.stderr


def test_processor_classes_stay_small_and_side_effect_free():
    for module in (processors.base, processors.qwen_vl, processors.llava, processors.pixtral):
        source = inspect.getsource(module)
        assert "os.environ" not in source and "getenv" not in source
    for cls in (processors.qwen_vl.Qwen2VLProcessor, processors.llava.LlavaProcessor,
                processors.pixtral.PixtralProcessor, MultimodalProcessor):
        assert "__del__" not in dir(cls)
