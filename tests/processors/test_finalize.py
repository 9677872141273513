"""The finalize lifecycle: model hook (split per image) → hash and pad value → wrap, last."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from engine.model_inputs import build_mm_kwargs
from engine.transport import WrappedFeature
from processors.errors import ItemLayoutError
from processors.finalize import bundle_item, content_hash, finalize


def noise(width, height, seed):
    generator = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy())


def layout(processor, features):
    """Placeholder offsets for the images of a bundle, laid out back to back from 0."""
    offsets, start = [], 0
    for i in range(processor.num_images(features)):
        length = len(processor.replacement_ids(features, i))
        offsets.append((start, start + length))
        start += length
    return offsets


def test_pixtral_bundle_splits_per_image_exactly(processors, transport, open_items):
    processor = processors["pixtral"]
    images = [noise(64, 48, 1), noise(30, 100, 2), noise(80, 80, 3)]
    bundle = processor.process_images(images, {})
    assert bundle["pixel_values"].shape[0] == 3  # bundled, padded to the largest size
    offsets = layout(processor, bundle)
    items = finalize([bundle_item("image", bundle, offsets, [{"part": i} for i in range(3)])],
                     processor=processor, transport=transport)
    opened = open_items(items)
    assert [item.offset for item in items] == offsets
    for item, image in zip(opened, images, strict=True):
        alone = processor.process_images([image], {})  # what the cache would hold for it
        assert item.features.keys() == alone.keys()
        assert all(torch.equal(item.features[name], alone[name]) for name in alone)
    # The GPU side reassembles exactly the HF processor's bundle (zero padding included).
    rebuilt = build_mm_kwargs(opened)
    assert all(torch.equal(rebuilt[name], bundle[name]) for name in bundle)


def test_counts_that_do_not_add_up_fail_loudly(processors, transport):
    pixtral, qwen = processors["pixtral"], processors["qwen2_vl"]
    bundle = pixtral.process_images([noise(64, 48, 1), noise(32, 32, 2)], {})
    offsets = layout(pixtral, bundle)
    with pytest.raises(ItemLayoutError, match="2 feature sets for 1 placeholder offsets"):
        finalize([bundle_item("image", bundle, offsets[:1], [{}])], processor=pixtral, transport=transport)
    with pytest.raises(ItemLayoutError, match="for features that need"):
        finalize([bundle_item("image", bundle, [offsets[0], (offsets[1][0], offsets[1][1] + 1)], [{}, {}])],
                 processor=pixtral, transport=transport)
    with pytest.raises(ItemLayoutError, match="overlap"):
        shifted = [(s - 1, e - 1) for s, e in offsets[1:]]
        finalize([bundle_item("image", bundle, [offsets[0], *shifted], [{}, {}])], processor=pixtral,
                 transport=transport)
    sizes = bundle["image_sizes"]
    with pytest.raises(ItemLayoutError, match="image_sizes"):
        pixtral.split_features({"pixel_values": bundle["pixel_values"], "image_sizes": sizes[:1]})

    features = qwen.process_images([noise(64, 48, 1)], {})
    with pytest.raises(ItemLayoutError, match="patch rows"):
        qwen.split_features({**features, "pixel_values": features["pixel_values"][:-1]})


def test_order_is_hook_then_hash_then_wrap(processors, transport):
    processor = processors["qwen2_vl"]
    bundle = processor.process_images([noise(64, 48, 1), noise(56, 56, 2)], {})
    seen = []

    def before_wrap(items):  # runs between step 2 and step 3
        for item in items:
            assert all(isinstance(t, torch.Tensor) for t in item.features.values())
            assert item.content_hash == content_hash(item.features)
        seen.extend(items)

    items = finalize([bundle_item("image", bundle, layout(processor, bundle), [{}, {}])],
                     processor=processor, transport=transport, before_wrap=before_wrap)
    assert len(seen) == 2 and seen[0].features["pixel_values"] is not None
    assert all(isinstance(f, WrappedFeature) for item in items for f in item.features.values())
    assert items[0].content_hash != items[1].content_hash
    assert items[0].features["pixel_values"].kind == "inline"


def test_content_hash_covers_names_dtypes_shapes_and_bytes():
    base = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    assert content_hash(base) == content_hash({"x": base["x"].clone()})
    assert content_hash(base) != content_hash({"y": base["x"]})
    assert content_hash(base) != content_hash({"x": base["x"].reshape(3, 2)})
    assert content_hash(base) != content_hash({"x": base["x"].to(torch.float64)})
    assert content_hash(base) != content_hash({"x": base["x"] + 1})
