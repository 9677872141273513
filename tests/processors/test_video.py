"""Video for Qwen2-VL and Qwen2.5-VL without torchvision: the stock video processor's patch
layout, placeholders expanded exactly once, the cache, and the model consuming the result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from engine.limits import Limits, MediaLimits
from engine.model_inputs import build_mm_kwargs
from processors.decode import DecodedVideo
from processors.pipeline import preprocess
from processors.qwen_video import qwen_video_features

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def stock_layout(frames: np.ndarray, image_processor) -> torch.Tensor:
    """The stock Qwen2-VL video processor's rows for frames it does not resize: normalise, then its
    patchify (transformers' Qwen2VLVideoProcessor.patchify: view into temporal, merge and patch
    blocks, permute to (t, h-block, w-block, mh, mw, C, temporal, ph, pw))."""
    mean = torch.tensor(image_processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(image_processor.image_std).view(1, 3, 1, 1)
    video = (torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255 - mean) / std
    t, c, h, w = video.shape
    tp, p, m = image_processor.temporal_patch_size, image_processor.patch_size, image_processor.merge_size
    patches = video.view(1, t // tp, tp, c, h // p // m, m, p, w // p // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(t // tp * (h // p) * (w // p), c * tp * p * p)


def test_layout_matches_the_stock_video_processor(processors):
    image_processor = processors["qwen2_vl"].hf.image_processor
    frames = np.random.default_rng(3).integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)  # kept as is
    features = qwen_video_features(image_processor, [DecodedVideo(frames, 2.0, 1.5)], {}, None)
    assert features["video_grid_thw"].tolist() == [[2, 4, 6]]
    expected = stock_layout(frames, image_processor)
    assert features["pixel_values_videos"].shape == expected.shape == (48, 1176)
    assert (features["pixel_values_videos"] - expected).abs().max() < 1e-5


def test_an_odd_frame_count_repeats_the_last_frame(processors):
    image_processor = processors["qwen2_vl"].hf.image_processor
    frames = np.random.default_rng(4).integers(0, 256, (3, 56, 84, 3), dtype=np.uint8)
    odd = qwen_video_features(image_processor, [DecodedVideo(frames, 2.0, 1.0)], {}, None)
    even = qwen_video_features(image_processor, [DecodedVideo(np.concatenate([frames, frames[-1:]]), 2.0, 1.0)], {},
                               None)
    assert odd["video_grid_thw"].tolist() == [[2, 4, 6]]
    assert torch.equal(odd["pixel_values_videos"], even["pixel_values_videos"])


@pytest.fixture
def run(processors, fetcher, transport, limits):
    def run_(request, *, arch="qwen2_vl", cache=None, limits=limits):
        return preprocess(request, processor=processors[arch], fetcher=fetcher, cache=cache,
                          transport=transport, limits=limits, owner="key_a")

    return run_


def test_a_video_job_expands_once_and_the_model_consumes_it(run, processors, models, video_url, open_items):
    processor = processors["qwen2_vl"]
    parts = [{"type": "video_url", "url": video_url(frames=4)}]
    text = run({"prompt": "What happens in <video>?", "content_parts": parts})
    (item,) = open_items(text.items)
    assert item.modality == "video" and set(item.features) == {"pixel_values_videos", "video_grid_thw"}
    assert item.features["video_grid_thw"].tolist() == [[2, 4, 4]]  # 4 frames of 64x48 -> 2 x 4 x 4 patches
    assert text.placeholder_ranges == [{"modality": "video", "offset": text.placeholder_ranges[0]["offset"],
                                        "length": 8}]
    pad = processor.token_id("video")
    assert text.prompt_token_ids.count(pad) == 8

    collapsed = processor.tokenizer(f"What happens in {VIDEO}?")["input_ids"]
    for token_ids in (collapsed, text.prompt_token_ids):  # collapsed, and already expanded: kept
        again = run({"token_ids": token_ids, "content_parts": parts})
        assert again.prompt_token_ids == text.prompt_token_ids
        assert again.placeholder_ranges == text.placeholder_ranges

    model = models("qwen2_vl")
    mm_kwargs = build_mm_kwargs([item])
    with torch.no_grad():
        rows = model.get_video_features(**mm_kwargs).pooler_output
    assert sum(part.shape[0] for part in rows) == 8
    input_ids = torch.tensor([text.prompt_token_ids])
    with torch.no_grad():
        logits = model(input_ids=input_ids, mm_token_type_ids=(input_ids == pad).long() * 2, **mm_kwargs).logits
    assert torch.isfinite(logits).all()


def test_qwen2_5_vl_videos_carry_seconds_per_grid(run, processors, models, video_url, open_items):
    processed = run({"prompt": "<video>", "content_parts": [{"type": "video_url", "url": video_url(frames=4)}]},
                    arch="qwen2_5_vl")
    (item,) = open_items(processed.items)
    # 4 frames at 2 fps: a temporal patch of 2 frames spans 1 s.
    assert item.features["second_per_grid_ts"].tolist() == [1.0]
    input_ids = torch.tensor([processed.prompt_token_ids])
    pad = processors["qwen2_5_vl"].token_id("video")
    with torch.no_grad():
        logits = models("qwen2_5_vl")(input_ids=input_ids, mm_token_type_ids=(input_ids == pad).long() * 2,
                                      **build_mm_kwargs([item])).logits
    assert torch.isfinite(logits).all()


def test_images_and_videos_pair_with_their_placeholders_per_modality(run, processors, image_url, video_url):
    processor = processors["qwen2_vl"]
    parts = [
        {"type": "video_url", "url": video_url(frames=2, seed=1)},
        {"type": "image_url", "url": image_url(seed=2)},
        {"type": "video_url", "url": video_url(frames=6, seed=3)},
    ]
    processed = run({"prompt": "<video> then <image> then <video>", "content_parts": parts})
    assert [r["modality"] for r in processed.placeholder_ranges] == ["video", "image", "video"]
    assert [r["length"] for r in processed.placeholder_ranges] == [4, 4, 12]
    assert [item.metadata["part"] for item in processed.items] == [0, 1, 2]
    ids = processed.prompt_token_ids
    for r in processed.placeholder_ranges:
        token = processor.token_id(r["modality"])
        assert ids[r["offset"]:r["offset"] + r["length"]] == [token] * r["length"]
    # The k-th video placeholder is the k-th video part, wherever the image part is listed.
    first = run({"prompt": f"{IMAGE} then {VIDEO} then {VIDEO}", "content_parts": parts})
    assert [r["modality"] for r in first.placeholder_ranges] == ["image", "video", "video"]
    assert [item.metadata["part"] for item in first.items] == [1, 0, 2]
    assert [r["length"] for r in first.placeholder_ranges] == [4, 4, 12]

    from engine.errors import PlaceholderMismatchError

    with pytest.raises(PlaceholderMismatchError, match="3 media placeholders for 3 media items"):
        run({"prompt": f"{IMAGE} then {IMAGE} then {VIDEO}", "content_parts": parts})


def test_videos_are_cached_by_uuid_and_by_content(run, cache, video_url, open_items):
    parts = [{"type": "video_url", "url": video_url(frames=4, seed=5)}]
    cold = run({"prompt": "<video>", "content_parts": parts}, cache=cache)
    warm = run({"prompt": "<video>", "content_parts": parts}, cache=cache)
    assert (cold.cache_hits, warm.cache_hits) == (0, 1)
    assert warm.prompt_token_ids == cold.prompt_token_ids
    assert [i.content_hash for i in warm.items] == [i.content_hash for i in cold.items]
    for want, got in zip(open_items(cold.items), open_items(warm.items), strict=True):
        assert all(torch.equal(want.features[k], got.features[k]) for k in want.features)

    named = [{**parts[0], "uuid": "clip-1"}]
    run({"prompt": "<video>", "content_parts": named}, cache=cache)
    # A uuid hit does not even fetch: a broken URL under a known uuid is served from the cache.
    broken = [{"type": "video_url", "url": "data:video/mp4;base64,AAAA", "uuid": "clip-1"}]
    assert run({"prompt": "<video>", "content_parts": broken}, cache=cache).cache_hits == 1

    # Other sampling settings make other frames: another cache entry.
    other = Limits(media=MediaLimits(video_fps=1.0))
    assert run({"prompt": "<video>", "content_parts": parts}, cache=cache, limits=other).cache_hits == 0


def test_frames_follow_the_checkpoints_video_size(processors, model_dirs, tmp_path):
    import json
    import shutil

    from processors.registry import load_processor

    directory = shutil.copytree(model_dirs["qwen2_vl"], tmp_path / "model")
    (directory / "video_preprocessor_config.json").write_text(json.dumps({"size": {
        "shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 2}}))
    processor = load_processor(directory)
    frames = np.stack([np.asarray(Image.new("RGB", (112, 112)))] * 2)
    features = processor.process("video", [DecodedVideo(frames, 2.0, 0.5)], {})
    assert features["video_grid_thw"].tolist() == [[1, 2, 2]]  # at most 2 x 28 x 28 pixels per frame
