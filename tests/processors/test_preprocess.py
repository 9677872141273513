"""The pipeline around the placeholders: errors of fetching and limits, timings, and the fixed
finalize lifecycle (features are wrapped last and refuse every access afterwards)."""

from __future__ import annotations

import base64

import pytest
import torch

from engine.errors import ContextLengthError, InvalidRequestError, WrappedFeatureAccessError
from engine.limits import Limits, MediaLimits
from engine.model_inputs import build_mm_kwargs
from engine.request_rules import TooManyContentPartsError
from engine.transport import WrappedFeature
from processors.errors import UnsupportedModalityError
from processors.fetch import MediaBlockedError, MediaDecodeError
from processors.pipeline import preprocess

QWEN = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture
def run(processors, fetcher, transport, limits):
    def run_(request, *, limits=limits, cache=None, arch="qwen2_vl"):
        return preprocess(request, processor=processors[arch], fetcher=fetcher, cache=cache,
                          transport=transport, limits=limits)

    return run_


def test_fetch_errors_keep_their_type_and_name_the_part(run, image_url):
    blocked = [{"type": "image_url", "url": image_url()}, {"type": "image_url", "url": "http://127.0.0.1/a.png"}]
    with pytest.raises(MediaBlockedError) as caught:
        run({"prompt": f"{QWEN}{QWEN}", "content_parts": blocked})
    assert caught.value.message.startswith("content_parts[1]: ")
    assert caught.value.errors == {"reason": "address", "part": 1} and caught.value.reason == "address"

    junk = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    with pytest.raises(MediaDecodeError, match=r"^content_parts\[0\]: "):
        run({"prompt": QWEN, "content_parts": [{"type": "image_url", "url": junk}]})


def test_modalities_a_model_does_not_take_and_unknown_parts_are_refused(run, image_url):
    with pytest.raises(UnsupportedModalityError, match=r"content_parts\[0\].*not video"):
        run({"prompt": "x", "content_parts": [{"type": "video_url", "url": image_url()}]}, arch="llava")
    with pytest.raises(UnsupportedModalityError, match=r"content_parts\[0\].*not audio"):
        run({"prompt": "x", "content_parts": [{"type": "audio_url", "url": image_url()}]})
    with pytest.raises(InvalidRequestError, match="unknown type"):
        run({"prompt": "x", "content_parts": [{"type": "file", "url": image_url()}]})


def test_request_shape_and_limits(run, processors, image_url):
    part = [{"type": "image_url", "url": image_url()}]
    with pytest.raises(InvalidRequestError) as both:
        run({"prompt": "a", "token_ids": [1]})
    assert both.value.code == "invalid_request" and set(both.value.errors) == {"token_ids"}
    with pytest.raises(InvalidRequestError, match=r"token_ids\[1\]"):
        run({"token_ids": [1, len(processors["qwen2_vl"].tokenizer)]})
    with pytest.raises(TooManyContentPartsError) as too_many:
        run({"prompt": QWEN * 2, "content_parts": part * 2}, limits=Limits(media=MediaLimits(max_items=1)))
    assert too_many.value.errors == {"count": 2, "limit": 1}
    # 4 image tokens + the frame + 6 text tokens: over a limit of 8 once expanded.
    with pytest.raises(ContextLengthError) as too_long:
        run({"prompt": f"{QWEN} describe it", "content_parts": part}, limits=Limits(context_tokens=8))
    assert too_long.value.errors["max_context"] == 8 and too_long.value.errors["prompt_tokens"] > 8


def test_text_only_prompt(run, processors):
    result = run({"prompt": "hello there"})
    assert result.items == [] and result.prompt_token_ids == processors["qwen2_vl"].tokenizer("hello there")["input_ids"]


def test_timings_and_wrapped_items(run, image_url, open_items):
    result = run({"prompt": f"{QWEN} and {QWEN}", "content_parts": [
        {"type": "image_url", "url": image_url(64, 48, 1)}, {"type": "image_url", "url": image_url(90, 40, 2)}]})
    assert set(result.timings) == {"fetch", "decode", "cache", "process", "finalize"}
    assert all(seconds >= 0 for seconds in result.timings.values()) and result.timings["process"] > 0
    assert [item.metadata["part"] for item in result.items] == [0, 1]

    # Finalize wrapped every feature last: the pipeline never touched one afterwards (a wrapped
    # feature refuses indexing, slicing, torch ops and tensor methods)...
    for item in result.items:
        assert item.content_hash and 0 <= item.pad_value < 2**30
        for feature in item.features.values():
            assert isinstance(feature, WrappedFeature)
            with pytest.raises(WrappedFeatureAccessError):
                feature[0]
            with pytest.raises(WrappedFeatureAccessError):
                torch.cat([feature, feature])
            with pytest.raises(WrappedFeatureAccessError):
                feature.reshape(-1)
    # ...and the engine-input assembly refuses wrapped items too: it needs opened handles.
    with pytest.raises(TypeError, match="wrapped"):
        build_mm_kwargs(result.items)
    kwargs = build_mm_kwargs(open_items(result.items))
    assert kwargs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 6]]
    assert kwargs["pixel_values"].shape == (16 + 12, 1176)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "pixtral"])
def test_an_image_past_the_aspect_ratio_limit_is_a_decode_error_naming_the_part(run, processors, image_url, arch):
    # Qwen-VL's resize raises a bare ValueError past 200:1 (once an internal_error); CLIP-style
    # shortest-edge resizers would blow a 20000x2 strip up to a billion pixels.
    placeholder = processors[arch].native_image_placeholder
    parts = [{"type": "image_url", "url": image_url(8, 8)}, {"type": "image_url", "url": image_url(20000, 2)}]
    with pytest.raises(MediaDecodeError, match=r"^content_parts\[1\]: the image is 20000x2") as caught:
        run({"prompt": placeholder * 2, "content_parts": parts}, arch=arch)
    assert caught.value.errors == {"part": 1}


def test_an_image_at_the_aspect_ratio_limit_is_processed(run, image_url):
    job = run({"prompt": QWEN, "content_parts": [{"type": "image_url", "url": image_url(200, 1)}]})
    assert len(job.items) == 1


def test_the_expanded_prompt_plus_max_tokens_is_held_to_the_context(processors, fetcher, transport, image_url):
    """An image prompt that fits alone but not with its max_tokens is refused once expanded (the API
    counted the collapsed prompt, and the engine the model's own context, so it passed both)."""
    part = [{"type": "image_url", "url": image_url()}]
    limits = Limits(context_tokens=20)
    request = {"prompt": f"{QWEN} describe it", "content_parts": part}
    fits = preprocess(request, processor=processors["qwen2_vl"], fetcher=fetcher, cache=None, transport=transport,
                      limits=limits, new_tokens=20 - 12)
    expanded = len(fits.prompt_token_ids)
    with pytest.raises(ContextLengthError) as caught:
        preprocess(request, processor=processors["qwen2_vl"], fetcher=fetcher, cache=None, transport=transport,
                   limits=limits, new_tokens=20 - expanded + 1)
    assert caught.value.errors == {"prompt_tokens": expanded, "max_tokens": 20 - expanded + 1, "max_context": 20}
