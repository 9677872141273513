"""One contract, every registered processor: on a tiny model of its architecture, a text prompt
and the equivalent token prompts (collapsed and already expanded) give identical results, cached
and uncached give identical results, each image gets exactly as many placeholders as the model
consumes feature rows for it, and the model runs a forward pass on the result."""

from __future__ import annotations

import pytest
import torch

from engine.model_inputs import build_mm_kwargs
from processors.pipeline import preprocess
from processors.registry import supported_architectures

# Every registered processor (as supported_architectures() names it) and its demo model.
DEMO_ARCH = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "LlavaForConditionalGeneration": "llava",
    "LlavaForConditionalGeneration (vision: pixtral)": "pixtral",
    "Qwen2_5OmniThinkerForConditionalGeneration": "qwen2_5_omni",
    "Qwen2AudioForConditionalGeneration": "qwen2_audio",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
}
IMAGE_DEMOS = sorted(name for name, arch in DEMO_ARCH.items() if arch not in ("qwen2_audio", "qwen3_moe"))


def test_every_registered_processor_has_a_demo_model():
    assert set(supported_architectures()) == set(DEMO_ARCH)


def _media_cases():
    """(registered processor, modality) for every modality but images (the contract below)."""
    from processors.registry import REGISTRY

    for registered, arch in sorted(DEMO_ARCH.items()):
        name, _, vision = registered.partition(" (vision: ")
        cls = REGISTRY.processor_class(name, vision.rstrip(")") or None)
        for modality in sorted(cls.modalities - {"image"}):
            yield pytest.param(arch, modality, id=f"{arch}-{modality}")


def assert_same(expected, actual, open_items):
    assert actual.prompt_token_ids == expected.prompt_token_ids
    assert actual.placeholder_ranges == expected.placeholder_ranges
    assert [i.content_hash for i in actual.items] == [i.content_hash for i in expected.items]
    assert [i.pad_value for i in actual.items] == [i.pad_value for i in expected.items]
    for want, got in zip(open_items(expected.items), open_items(actual.items), strict=True):
        assert want.features.keys() == got.features.keys()
        for name in want.features:
            assert got.features[name].dtype == want.features[name].dtype
            assert torch.equal(got.features[name], want.features[name]), name


def image_rows(model, mm_kwargs) -> list[int]:
    """Feature rows the model's vision side produces per image (what replaces placeholders)."""
    with torch.no_grad():
        pooled = model.get_image_features(**mm_kwargs).pooler_output
    if isinstance(pooled, torch.Tensor) and pooled.dim() == 3:  # (images, rows, hidden)
        return [pooled.shape[1]] * pooled.shape[0]
    return [part.shape[0] for part in pooled]


@pytest.mark.parametrize("registered", IMAGE_DEMOS)
def test_processor_contract(
    registered, processors, models, fetcher, transport, cache, limits, image_url, open_items
):
    arch = DEMO_ARCH[registered]
    processor = processors[arch]
    parts = [
        {"type": "image_url", "url": image_url(64, 48, seed=1)},
        {"type": "image_url", "url": image_url(40, 90, seed=2)},
    ]
    native = processor.native_image_placeholder
    prompt = f"Compare {native} with <image> and answer briefly."

    def run(request, with_cache=False):
        return preprocess(
            request, processor=processor, fetcher=fetcher, cache=cache if with_cache else None,
            transport=transport, limits=limits, owner="key_a",
        )

    text = run({"prompt": prompt, "content_parts": parts})
    assert len(text.items) == 2 and text.cache_hits == 0

    # The same prompt as token ids: one collapsed placeholder per image, then fully expanded.
    collapsed = processor.tokenizer(prompt.replace("<image>", native))["input_ids"]
    assert len(collapsed) < len(text.prompt_token_ids)
    assert_same(text, run({"token_ids": collapsed, "content_parts": parts}), open_items)
    assert_same(text, run({"token_ids": text.prompt_token_ids, "content_parts": parts}), open_items)

    cold = run({"prompt": prompt, "content_parts": parts}, with_cache=True)
    warm = run({"prompt": prompt, "content_parts": parts}, with_cache=True)  # this worker's memory
    assert (cold.cache_hits, warm.cache_hits) == (0, 2)
    assert_same(text, cold, open_items)
    assert_same(text, warm, open_items)
    cache.clear_local()
    shared = run({"prompt": prompt, "content_parts": parts}, with_cache=True)  # from Redis
    assert shared.cache_hits == 2
    assert_same(text, shared, open_items)

    # The fast path's replacement runs are the HF processor's own.
    for item in open_items(text.items):
        hf_text = processor.hf.replace_image_token(item.features, image_idx=0)
        assert processor.replacement_ids(item.features, 0) == processor.tokenizer(
            hf_text, add_special_tokens=False)["input_ids"]

    # Placeholders per image == feature rows the model consumes for it; then a forward pass.
    model = models(arch)
    mm_kwargs = build_mm_kwargs(open_items(warm.items))
    placeholders = [
        processor.embed_token_count(warm.prompt_token_ids[r["offset"]:r["offset"] + r["length"]])
        for r in warm.placeholder_ranges
    ]
    assert placeholders == image_rows(model, mm_kwargs)
    assert sum(placeholders) == sum(t == processor.image_token_id for t in warm.prompt_token_ids)

    input_ids = torch.tensor([warm.prompt_token_ids])
    extra = {}
    if "mm_token_type_ids" in processor.hf.model_input_names:
        extra["mm_token_type_ids"] = (input_ids == processor.image_token_id).long()
    with torch.no_grad():
        logits = model(input_ids=input_ids, **mm_kwargs, **extra).logits
    assert logits.shape[:2] == input_ids.shape and torch.isfinite(logits).all()


def media_parts(modality, video_url, audio_url):
    if modality == "video":
        return [{"type": "video_url", "url": video_url(frames=4, seed=1)},
                {"type": "video_url", "url": video_url(frames=3, width=40, height=90, seed=2)}]
    return [{"type": "audio_url", "url": audio_url(1.0, seed=1)},
            {"type": "audio_url", "url": audio_url(0.3, rate=44_100, seed=2)}]


def feature_rows(model, modality, mm_kwargs) -> int:
    """Rows the model's encoder makes for all items of ``modality`` (what fills the placeholders)."""
    with torch.no_grad():
        if modality == "video":
            pooled = model.get_video_features(pixel_values_videos=mm_kwargs["pixel_values_videos"],
                                              video_grid_thw=mm_kwargs["video_grid_thw"]).pooler_output
            return sum(part.shape[0] for part in pooled)
        if hasattr(model, "get_audio_features"):
            out = model.get_audio_features(mm_kwargs["input_features"], mm_kwargs["feature_attention_mask"])
            return out.last_hidden_state.shape[0]
        # Qwen2-Audio: the lengths its forward keeps of the encoder's output (and checks against the tokens).
        _, lengths = model.model.audio_tower._get_feat_extract_output_lengths(mm_kwargs["feature_attention_mask"].sum(-1))
        return int(lengths.sum())


@pytest.mark.parametrize(("arch", "modality"), list(_media_cases()))
def test_media_contract(arch, modality, processors, models, fetcher, transport, cache, limits, video_url,
                        audio_url, open_items):
    """The contract for video and audio: text vs token prompts (collapsed and expanded), cached vs
    uncached agree; placeholders equal the encoder's rows; the model runs on the result."""
    processor = processors[arch]
    parts = media_parts(modality, video_url, audio_url)
    native = processor.native_placeholder(modality)
    sentinel = f"<{modality}>"
    prompt = f"First {native} then {sentinel}, briefly."

    def run(request, with_cache=False):
        return preprocess(request, processor=processor, fetcher=fetcher, cache=cache if with_cache else None,
                          transport=transport, limits=limits, owner="key_a")

    text = run({"prompt": prompt, "content_parts": parts})
    assert [r["modality"] for r in text.placeholder_ranges] == [modality, modality]
    collapsed = processor.tokenizer(prompt.replace(sentinel, native))["input_ids"]
    assert_same(text, run({"token_ids": collapsed, "content_parts": parts}), open_items)
    assert_same(text, run({"token_ids": text.prompt_token_ids, "content_parts": parts}), open_items)

    cold = run({"prompt": prompt, "content_parts": parts}, with_cache=True)
    warm = run({"prompt": prompt, "content_parts": parts}, with_cache=True)
    cache.clear_local()
    shared = run({"prompt": prompt, "content_parts": parts}, with_cache=True)
    assert (cold.cache_hits, warm.cache_hits, shared.cache_hits) == (0, 2, 2)
    for other in (cold, warm, shared):
        assert_same(text, other, open_items)

    token = processor.token_id(modality)
    model = models(arch)
    mm_kwargs = build_mm_kwargs(open_items(warm.items))
    assert feature_rows(model, modality, mm_kwargs) == warm.prompt_token_ids.count(token)
    assert sum(r["length"] for r in warm.placeholder_ranges) == warm.prompt_token_ids.count(token)

    input_ids = torch.tensor([warm.prompt_token_ids])
    extra = {}
    if "mm_token_type_ids" in processor.hf.model_input_names:
        extra["mm_token_type_ids"] = (input_ids == token).long() * 2
    with torch.no_grad():
        logits = model(input_ids=input_ids, **mm_kwargs, **extra).logits
    assert logits.shape[:2] == input_ids.shape and torch.isfinite(logits).all()
