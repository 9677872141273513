"""Precomputed ``features`` instead of media: the documented format, validated strictly."""

from __future__ import annotations

import base64
import copy

import pytest
import torch

from engine.demo_model import IMAGE_ARCHS
from engine.errors import Fault, PayloadTooLargeError, PlaceholderMismatchError
from engine.limits import Limits, MediaLimits
from processors.decode import decode_image
from processors.errors import InvalidFeaturesError, UnsupportedModalityError
from processors.features_codec import encode_features
from processors.pipeline import preprocess


def per_image_features(processor, fetcher, urls):
    images = [decode_image(fetcher.fetch(url).data, max_pixels=10**8) for url in urls]
    return [processor.process_images([image], {}) for image in images]


@pytest.mark.parametrize("arch", IMAGE_ARCHS)
def test_features_give_what_media_gives(arch, processors, fetcher, transport, limits, image_url, open_items):
    processor = processors[arch]
    urls = [image_url(64, 48, 1), image_url(40, 90, 2)]
    prompt = "a <image> b <image>"

    def run(**request):
        return preprocess({"prompt": prompt, **request}, processor=processor, fetcher=fetcher, cache=None,
                          transport=transport, limits=limits)

    from_media = run(content_parts=[{"type": "image_url", "url": u} for u in urls])
    wire = [encode_features(f) for f in per_image_features(processor, fetcher, urls)]
    from_features = run(features=wire)
    assert from_features.prompt_token_ids == from_media.prompt_token_ids
    assert from_features.placeholder_ranges == from_media.placeholder_ranges
    assert [i.content_hash for i in from_features.items] == [i.content_hash for i in from_media.items]
    with pytest.raises(PlaceholderMismatchError) as caught:  # no raw media: no HF fallback
        run(features=wire[:1])
    assert (caught.value.placeholders, caught.value.items) == (2, 1)


@pytest.fixture
def qwen_entry(processors, fetcher, image_url):
    return encode_features(per_image_features(processors["qwen2_vl"], fetcher, [image_url()])[0])


def b64(tensor):
    return base64.b64encode(tensor.contiguous().view(torch.uint8).numpy().tobytes()).decode()


def mutate(entry, path, value):
    entry = copy.deepcopy(entry)
    *parents, last = path
    target = entry
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return entry


PV, GRID = ("tensors", "pixel_values"), ("tensors", "image_grid_thw")
CASES = {
    "extra key": ((("extra",), 1), "features[0]"),
    "missing tensor": (((*GRID[:1], "image_grid_thw"), KeyError), "features[0].tensors"),
    "unknown tensor": (((*PV[:1], "pixel_values_videos"), {}), "features[0].tensors"),
    "unknown dtype": (((*PV, "dtype"), "float8"), "features[0].tensors.pixel_values.dtype"),
    "dtype not a string": (((*PV, "dtype"), 3), "features[0].tensors.pixel_values.dtype"),
    "negative dim": (((*PV, "shape"), [-16, 1176]), "features[0].tensors.pixel_values.shape"),
    "bool dim": (((*PV, "shape"), [True, 1176]), "features[0].tensors.pixel_values.shape"),
    "too many dims": (((*PV, "shape"), [1] * 9), "features[0].tensors.pixel_values.shape"),
    "spec key missing": (((*PV, "data"), KeyError), "features[0].tensors.pixel_values"),
    "bad base64": (((*PV, "data"), "***"), "features[0].tensors.pixel_values.data"),
    "short data": (((*PV, "data"), b64(torch.zeros(3))), "features[0].tensors.pixel_values.data"),
    "nan": (((*PV, "data"), b64(torch.full((16, 1176), float("nan")))), "features[0].tensors.pixel_values"),
    # Finite but absurd: 3e38 made a job "succeed" with NaN logprobs and left its KV blocks dirty.
    "huge": (((*PV, "data"), b64(torch.full((16, 1176), 3e38))), "features[0].tensors.pixel_values"),
    "past fp16": (((*PV, "data"), b64(torch.full((16, 1176), -7e4))), "features[0].tensors.pixel_values"),
    "grid disagrees": (((*GRID, "data"), b64(torch.tensor([[1, 2, 4]]))), "features[0]"),
    "grid not int64": ((GRID, {"dtype": "int32", "shape": [1, 3], "data": b64(torch.tensor([[1, 4, 4]], dtype=torch.int32))}),
                       "features[0]"),
    "two images in one entry": ((GRID, {"dtype": "int64", "shape": [2, 3], "data": b64(torch.tensor([[1, 2, 2]] * 2))}),
                                "features[0]"),
    "pixels as ints": ((PV, {"dtype": "int32", "shape": [16, 1176], "data": b64(torch.zeros(16, 1176, dtype=torch.int32))}),
                       "features[0]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_features_name_the_field(case, qwen_entry, processors, fetcher, transport, limits):
    (path, value), where = CASES[case]
    with pytest.raises(InvalidFeaturesError) as caught:
        preprocess({"prompt": "<image>", "features": [mutate(qwen_entry, path, value)]},
                   processor=processors["qwen2_vl"], fetcher=fetcher, cache=None, transport=transport, limits=limits)
    assert caught.value.errors == {"path": where} and caught.value.fault is Fault.INVALID
    assert caught.value.message.startswith(where)


def test_modality_and_size_caps(qwen_entry, processors, fetcher, transport):
    def run(features, limits=None):
        return preprocess({"prompt": "<image>", "features": features}, processor=processors["qwen2_vl"],
                          fetcher=fetcher, cache=None, transport=transport, limits=limits or Limits())

    with pytest.raises(UnsupportedModalityError):
        run([{**qwen_entry, "modality": "video"}])
    with pytest.raises(PayloadTooLargeError):
        run([qwen_entry], Limits(media=MediaLimits(max_feature_bytes=1000)))
    with pytest.raises(InvalidFeaturesError):
        run([])
