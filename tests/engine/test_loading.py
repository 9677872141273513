"""Model loading: what LoadedModel exposes, typed errors, and a stable weight_version."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.checkpoints import weight_version_of
from engine.errors import Fault, InvalidRequestError, ModelLoadError
from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams


def test_loaded_model_describes_the_demo_qwen2_vl(loaded):
    assert loaded.architecture == "Qwen2VLForConditionalGeneration"
    assert loaded.model_type == "qwen2_vl"
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert loaded.eos_token_ids == (loaded.model.config.text_config.eos_token_id,)
    assert loaded.pad_token_id == loaded.model.config.text_config.pad_token_id
    assert loaded.context_tokens == 4096
    config = loaded.model.config
    assert loaded.media_token_ids == {"image": config.image_token_id, "video": config.video_token_id}
    assert loaded.uses_mm_token_type_ids
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert len(loaded.weight_version) == 16


def test_weight_version_is_content_based(tmp_path, demo_model_dir, loaded):
    from engine.demo_model import build_demo_model

    rebuilt = build_demo_model(tmp_path / "again")
    assert weight_version_of(rebuilt) == loaded.weight_version  # byte-identical build, same version
    changed = tmp_path / "changed"
    shutil.copytree(demo_model_dir, changed)
    (changed / "model.safetensors").write_bytes((changed / "model.safetensors").read_bytes()[:-1] + b"\1")
    assert weight_version_of(changed) != loaded.weight_version
    tokenizer_only = tmp_path / "tokenizer-only"
    shutil.copytree(demo_model_dir, tokenizer_only)
    (tokenizer_only / "tokenizer_config.json").write_text("{}")
    assert weight_version_of(tokenizer_only) == loaded.weight_version


def test_explicit_weight_version_wins(demo_model_dir):
    assert load_model(str(demo_model_dir), device="cpu", weight_version="step-42").weight_version == "step-42"


@pytest.mark.parametrize("path", ["/does/not/exist", "./nope/../x", ""])
def test_missing_model_path_is_a_typed_error(path):
    with pytest.raises(ModelLoadError) as info:
        load_model(path, device="cpu")
    assert isinstance(info.value, InvalidRequestError)
    assert info.value.code == "model_load_failed" and info.value.fault is Fault.INVALID


def test_directory_without_a_model_is_a_typed_error(tmp_path):
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path), device="cpu")


def test_uncached_hub_id_offline_is_a_typed_error():
    with pytest.raises(ModelLoadError):
        load_model("rollout-queue-tests/no-such-model", device="cpu", local_files_only=True)


def test_bad_device_and_dtype_are_typed_errors(demo_model_dir):
    with pytest.raises(ModelLoadError):
        load_model(str(demo_model_dir), device="tpu")
    with pytest.raises(ModelLoadError):
        load_model(str(demo_model_dir), device="cpu", dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError):
            load_model(str(demo_model_dir), device="cuda")


def test_text_only_model_falls_back_to_causal_lm(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.architecture == "Qwen2ForCausalLM"
    assert loaded.media_token_ids == {} and not loaded.uses_mm_token_type_ids
    assert loaded.eos_token_ids == (1,) and loaded.context_tokens == 64
    result = Engine(loaded).generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=4, temperature=0,
                                                                                   ignore_eos=True))])[0]
    assert len(result.choices[0].token_ids) == 4


@pytest.mark.gpu
def test_auto_device_is_cuda_when_available(demo_model_dir):
    loaded = load_model(str(demo_model_dir))
    assert loaded.device.type == "cuda"


def test_an_audio_only_model_loads_and_generates_from_audio_features(tmp_path):
    # Qwen2-Audio is in no image-text-to-text or causal-LM mapping: the multimodal-LM one serves it.
    import numpy as np
    from transformers import WhisperFeatureExtractor

    from engine.demo_model import build_demo_model

    loaded = load_model(str(build_demo_model(tmp_path / "audio", arch="qwen2_audio")), device="cpu")
    assert loaded.architecture == "Qwen2AudioForConditionalGeneration"
    assert set(loaded.media_token_ids) == {"audio"} and not loaded.uses_mm_token_type_ids
    tone = np.sin(np.arange(16_000) / 16_000 * 2 * np.pi * 440).astype(np.float32)
    features = WhisperFeatureExtractor(feature_size=128)([tone], sampling_rate=16_000, return_attention_mask=True,
                                                         padding="max_length", return_tensors="pt")
    mm_kwargs = {"input_features": features["input_features"], "feature_attention_mask": features["attention_mask"]}
    prompt = [1, 4, *[loaded.media_token_ids["audio"]] * 25, 5, 20, 21]  # 1 s: 25 audio tokens
    greedy = SamplingParams(max_tokens=4, temperature=0)
    alone, batched = (Engine(loaded).generate(requests) for requests in (
        [GenerationRequest(prompt, greedy, mm_kwargs=mm_kwargs)],
        [GenerationRequest([1, 20], greedy), GenerationRequest(prompt, greedy, mm_kwargs=mm_kwargs)]))
    assert alone[0].choices[0].token_ids == batched[1].choices[0].token_ids
    assert len(alone[0].choices[0].logprobs) == 4
