"""Audio on the Qwen2.5-Omni thinker: Whisper features, resampling, <|AUDIO|> runs of the
encoder's length, the duration caps; and one prompt with an image, a video and an audio."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile as sf
import torch

from engine.errors import Fault
from engine.limits import Limits, MediaLimits
from engine.model_inputs import build_mm_kwargs
from processors.fetch import MediaDecodeError, MediaTooLargeError
from processors.pipeline import preprocess

AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"


@pytest.fixture
def run(processors, fetcher, transport, limits):
    def run_(request, *, limits=limits, cache=None):
        return preprocess(request, processor=processors["qwen2_5_omni"], fetcher=fetcher, cache=cache,
                          transport=transport, limits=limits, owner="key_a")

    return run_


@pytest.mark.parametrize(("seconds", "tokens"), [(1.0, 25), (0.3, 7), (5.0, 125)])
def test_audio_takes_25_tokens_a_second(run, audio_url, open_items, seconds, tokens):
    processed = run({"prompt": "Listen: <audio>", "content_parts": [{"type": "audio_url", "url": audio_url(seconds)}]})
    assert processed.placeholder_ranges[0]["modality"] == "audio"
    assert processed.placeholder_ranges[0]["length"] == tokens
    (item,) = open_items(processed.items)
    assert item.features["input_features"].shape == (1, 128, 3000)
    assert int(item.features["feature_attention_mask"].sum()) == int(seconds * 100)


def test_other_rates_are_resampled_to_the_extractors(run, audio_url, open_items):
    native = run({"prompt": "<audio>", "content_parts": [{"type": "audio_url", "url": audio_url(1.0)}]})
    resampled = run({"prompt": "<audio>", "content_parts": [{"type": "audio_url", "url": audio_url(1.0, 44_100)}]})
    assert resampled.prompt_token_ids == native.prompt_token_ids
    want, got = (open_items(p.items)[0].features["input_features"] for p in (native, resampled))
    assert (want - got).abs().mean() < 0.05  # the same tone and noise, through another rate


def test_audio_caps_and_implausible_rates(run, audio_url):
    url = audio_url(2.0)
    with pytest.raises(MediaTooLargeError, match=r"^content_parts\[0\]: the audio is longer than 1.0 s"):
        run({"prompt": "<audio>", "content_parts": [{"type": "audio_url", "url": url}]},
            limits=Limits(media=MediaLimits(max_audio_seconds=1.0)))
    # Past the model's 30 s window: refused, never silently cut.
    with pytest.raises(MediaTooLargeError, match="the model's 30 s window"):
        run({"prompt": "<audio>", "content_parts": [{"type": "audio_url", "url": audio_url(31.0, rate=1_000)}]},
            limits=Limits(media=MediaLimits(max_audio_seconds=60.0)))
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros(5, np.float32), 1, format="WAV")  # 5 s at 1 Hz
    one_hertz = "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()
    with pytest.raises(MediaDecodeError, match="sample rate"):
        run({"prompt": "<audio>", "content_parts": [{"type": "audio_url", "url": one_hertz}]})


def test_image_video_and_audio_in_one_prompt(run, processors, models, image_url, video_url, audio_url,
                                             open_items, cache):
    processor = processors["qwen2_5_omni"]
    parts = [
        {"type": "image_url", "url": image_url()},
        {"type": "video_url", "url": video_url(frames=4)},
        {"type": "audio_url", "url": audio_url(1.0)},
    ]
    prompt = "Look <image>, watch <video>, listen <audio>: what is going on?"
    processed = run({"prompt": prompt, "content_parts": parts}, cache=cache)
    assert [(r["modality"], r["length"]) for r in processed.placeholder_ranges] == [
        ("image", 4), ("video", 8), ("audio", 25)]
    collapsed = processor.tokenizer(processor.normalize_prompt(prompt)[0])["input_ids"]
    again = run({"token_ids": collapsed, "content_parts": parts}, cache=cache)
    assert again.prompt_token_ids == processed.prompt_token_ids and again.cache_hits == 3

    items = open_items(processed.items)
    assert set(items[1].features) == {"pixel_values_videos", "video_grid_thw", "video_second_per_grid"}
    input_ids = torch.tensor([processed.prompt_token_ids])
    with torch.no_grad():
        logits = models("qwen2_5_omni")(input_ids=input_ids, **build_mm_kwargs(items)).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["qwen2_5_omni", "qwen2_audio"])
@pytest.mark.parametrize("milliseconds", [1, 10, 20])
def test_audio_too_short_for_the_encoder_says_so(processors, fetcher, transport, limits, audio_url, arch, milliseconds):
    """A few milliseconds make no encoder feature: "too short", not a placeholder mismatch."""
    from processors.fetch import MediaTooShortError

    with pytest.raises(MediaTooShortError, match=r"content_parts\[0\]: the audio is too short") as caught:
        preprocess({"prompt": "<audio>", "content_parts": [{"type": "audio_url", "url": audio_url(milliseconds / 1000)}]},
                   processor=processors[arch], fetcher=fetcher, cache=None, transport=transport, limits=limits)
    assert caught.value.code == "media_too_short" and caught.value.fault is Fault.INVALID
