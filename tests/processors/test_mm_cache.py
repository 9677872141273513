"""The multimodal cache: exact round trips, keys, LRU eviction under a byte cap, and its use by
the pipeline (a uuid hit skips fetching; cached and uncached results agree; uuid entries are
private to their owner)."""

from __future__ import annotations

import uuid

import pytest
import redis
import torch
from safetensors.torch import save

from engine.errors import MediaError
from processors.cache import MultimodalCache
from processors.pipeline import preprocess

QWEN = "<|vision_start|><|image_pad|><|vision_end|>"


def other_worker(cache, redis_url, **kwargs):
    """A cache like another worker process of the node has: same Redis, its own local tier."""
    return MultimodalCache(redis.Redis.from_url(redis_url), max_bytes=cache.max_bytes,
                           namespace=cache._lru.rsplit(":", 1)[0], **kwargs)


def test_round_trip_through_redis_is_bit_exact(cache, redis_url):
    features = {
        "pixel_values": torch.randn(5, 7, dtype=torch.bfloat16),
        "grid": torch.tensor([[1, 2, 3]]),
        "half": torch.randn(3).half(),
    }
    assert cache.put("k", features, "hash-k")
    got = other_worker(cache, redis_url).get("k")  # nothing local: read from Redis
    assert got.content_hash == "hash-k" and got.features.keys() == features.keys()
    for name, tensor in features.items():
        assert got.features[name].dtype == tensor.dtype and torch.equal(got.features[name], tensor)
    assert cache.get("missing") is None


def test_local_tier_serves_repeats_and_is_byte_capped(cache, redis_url):
    worker = other_worker(cache, redis_url, local_max_bytes=2 * 4000 + 100)
    for name in "abc":
        cache.put(name, {"x": torch.full((1000,), float(ord(name)))}, name)
    for name in "abc":
        assert worker.get(name).content_hash == name  # from Redis, remembered locally
    cache._redis.delete(*(cache._prefix + n for n in "abc"))  # gone from Redis...
    assert worker.get("a") is None  # ...a was evicted locally (3 entries, room for 2)
    assert torch.equal(worker.get("c").features["x"], torch.full((1000,), float(ord("c"))))
    assert worker.get("b") is not None
    view = torch.arange(10.0)
    cache.put("view", {"x": view[2:5]}, "v")  # stored as its own copy, not a view of the bundle
    assert cache.get("view").features["x"].untyped_storage().nbytes() == 3 * 4


def test_keys_separate_sources_models_and_options():
    key = MultimodalCache.key
    base = {"model_id": "m", "modality": "image", "options": {}}
    assert key(**base, uuid="a", owner="A") == key(**base, uuid="a", owner="A")
    distinct = {
        key(**base, uuid="a", owner="A"), key(**base, uuid="b", owner="A"), key(**base, uuid="a", owner="B"),
        key(**base, media_sha256="a"), key(**{**base, "model_id": "n"}, uuid="a", owner="A"),
        key(**{**base, "options": {"size": 1}}, uuid="a", owner="A"),
        key(**{**base, "modality": "video"}, uuid="a", owner="A"),
    }
    assert len(distinct) == 7
    with pytest.raises(ValueError):
        key(**base)
    with pytest.raises(ValueError):
        key(**base, uuid="a", owner="A", media_sha256="b")
    with pytest.raises(ValueError):  # a uuid names nothing without the key that chose it
        key(**base, uuid="a")
    with pytest.raises(ValueError):
        key(**base, media_sha256="a", owner="A")


def test_lru_eviction_keeps_the_total_under_the_cap(redis_client):
    entry = {"x": torch.zeros(1000)}  # ~4 KB each
    size = len(save(entry, metadata={"content_hash": "h"}))
    cache = MultimodalCache(redis_client, max_bytes=3 * size + size // 2, namespace=f"test:{uuid.uuid4().hex}",
                            local_max_bytes=0)  # the Redis tier alone
    try:
        for name in "abc":
            cache.put(name, entry, "h")
        assert len(cache) == 3 and cache.total_bytes() == 3 * size
        assert cache.get("a") is not None  # a is now the most recently used; b the oldest
        cache.put("d", entry, "h")
        assert [cache.get(n) is not None for n in "abcd"] == [True, False, True, True]
        assert len(cache) == 3 and cache.total_bytes() == 3 * size <= cache.max_bytes
        cache.put("d", entry, "h")  # overwriting does not count twice
        assert cache.total_bytes() == 3 * size
        assert not cache.put("huge", {"x": torch.zeros(10_000)}, "h")  # larger than the cap alone
        assert cache.get("huge") is None
    finally:
        cache.clear()
    assert cache.total_bytes() == 0 and len(cache) == 0


@pytest.fixture
def run(processors, fetcher, transport, limits, cache):
    def run_(parts, *, options=None, use_cache=True, owner="key_a"):
        return preprocess({"prompt": QWEN * len(parts), "content_parts": parts}, processor=processors["qwen2_vl"],
                          fetcher=fetcher, cache=cache if use_cache else None, transport=transport, limits=limits,
                          options=options, owner=owner)

    return run_


def test_uuid_hit_skips_fetching(run, image_url, open_items):
    first = run([{"type": "image_url", "url": image_url(64, 48, 7), "uuid": "photo-7"}])
    # Same uuid, a URL the fetch policy refuses: served from the cache, never fetched.
    again = run([{"type": "image_url", "url": "http://127.0.0.1/refused.png", "uuid": "photo-7"}])
    assert (first.cache_hits, again.cache_hits) == (0, 1)
    assert again.timings["fetch"] == again.timings["decode"] == again.timings["process"] == 0
    assert again.prompt_token_ids == first.prompt_token_ids
    assert [i.content_hash for i in again.items] == [i.content_hash for i in first.items]


def test_uuid_entries_are_private_to_their_owner(run, image_url):
    """Key B knows key A's uuid: it can neither read A's entry (a dead URL must not be served from
    it) nor plant one that A's later job would use instead of A's own image."""
    dead = "http://127.0.0.1/refused.png"
    a_image = run([{"type": "image_url", "url": image_url(64, 48, 11), "uuid": "sample-000123"}], owner="key_a")
    with pytest.raises(MediaError):
        run([{"type": "image_url", "url": dead, "uuid": "sample-000123"}], owner="key_b")
    assert run([{"type": "image_url", "url": dead, "uuid": "sample-000123"}], owner="key_a").cache_hits == 1

    planted = run([{"type": "image_url", "url": image_url(90, 40, 12), "uuid": "sample-000124"}], owner="key_b")
    mine = run([{"type": "image_url", "url": image_url(64, 48, 13), "uuid": "sample-000124"}], owner="key_a")
    assert mine.cache_hits == 0 and mine.timings["fetch"] > 0
    assert mine.placeholder_ranges[0]["length"] == a_image.placeholder_ranges[0]["length"] == 4
    assert mine.items[0].content_hash != planted.items[0].content_hash
    # Without an owner a uuid names nothing: the bytes' sha256 is the key.
    with pytest.raises(MediaError):
        run([{"type": "image_url", "url": dead, "uuid": "sample-000123"}], owner=None)


def test_content_addressed_entries_are_shared_between_owners(run, image_url):
    url = image_url(64, 48, 14)
    assert run([{"type": "image_url", "url": url}], owner="key_a").cache_hits == 0
    assert run([{"type": "image_url", "url": url}], owner="key_b").cache_hits == 1


def test_sha256_hit_skips_decode_and_processing(run, image_url, open_items):
    url = image_url(90, 40, 3)
    parts = [{"type": "image_url", "url": url}, {"type": "image_url", "url": image_url(64, 48, 4)}]
    uncached = run(parts, use_cache=False)
    cold = run(parts)
    warm = run(list(reversed(parts)))  # hits in any order
    assert (cold.cache_hits, warm.cache_hits) == (0, 2)
    assert warm.timings["process"] == 0 and warm.timings["fetch"] > 0
    assert [i.content_hash for i in cold.items] == [i.content_hash for i in uncached.items]
    assert [i.content_hash for i in warm.items] == [i.content_hash for i in reversed(uncached.items)]
    for want, got in zip(open_items(uncached.items), open_items(reversed(warm.items)), strict=True):
        assert all(torch.equal(want.features[n], got.features[n]) for n in want.features)

    mixed = run([parts[0], {"type": "image_url", "url": image_url(56, 56, 5)}])  # one hit, one miss
    assert mixed.cache_hits == 1 and [r["length"] for r in mixed.placeholder_ranges] == [3, 4]


def test_processor_options_are_part_of_the_key(run, image_url):
    parts = [{"type": "image_url", "url": image_url(64, 48, 8)}]
    run(parts)
    small = run(parts, options={"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28}})
    assert small.cache_hits == 0 and small.placeholder_ranges[0]["length"] == 1
    assert run(parts).cache_hits == 1
