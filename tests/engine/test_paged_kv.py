"""The KV pool (engine/paged_kv.py): prompts written into blocks, a decode step's paged cache
writing one slot per row and reading each row's whole K/V back, reference counts, and the mask.
No model: a real DynamicCache of random tensors stands in for a prefill's output."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engine.errors import Fault, KVPoolExhausted
from engine.paged_kv import (
    NULL_BLOCK,
    BlockPool,
    PagedPrompt,
    PagedStep,
    decode_mask,
    flat_slots,
    prefix_cache,
    write_prompts,
)

HEADS, DIM, LAYERS = 2, 4, 2


def prefill(lengths: list[int]) -> tuple[DynamicCache, torch.Tensor, list[list[torch.Tensor]]]:
    """A left-padded prefill cache of rows of ``lengths``, its mask, and each row's unpadded keys."""
    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    cache = DynamicCache()
    for layer in range(LAYERS):
        cache.update(torch.randn(len(lengths), HEADS, width, DIM), torch.randn(len(lengths), HEADS, width, DIM), layer)
    keys = [[cache.layers[layer].keys[row, :, width - n:] for layer in range(LAYERS)] for row, n in enumerate(lengths)]
    return cache, mask, keys


def test_prompts_are_written_without_padding_and_read_back_with_each_new_token():
    pool = BlockPool(capacity=8, block_size=4)
    cache, mask, keys = prefill([3, 6])
    short, long = write_prompts(pool, cache, mask.sum(-1).tolist())
    assert (short.length, len(short.blocks)) == (3, 1) and (long.length, len(long.blocks)) == (6, 2)
    assert pool.in_use == 3
    # One decode step: each row writes its new token into the slot after its prompt.
    tables = torch.tensor([short.blocks + [NULL_BLOCK], long.blocks])
    writes = torch.tensor([short.blocks[0] * 4 + 3, long.blocks[1] * 4 + 2])
    step = PagedStep(pool, tables, writes, width=7)
    for layer in range(LAYERS):
        new_keys, new_values = torch.randn(2, HEADS, 1, DIM), torch.randn(2, HEADS, 1, DIM)
        got_keys, got_values = step.update(new_keys, new_values, layer)
        assert got_keys.shape == got_values.shape == (2, HEADS, 7, DIM) and step.get_seq_length() == 7
        assert torch.equal(got_keys[0, :, :4], torch.cat([keys[0][layer], new_keys[0]], dim=1))
        assert torch.equal(got_keys[1], torch.cat([keys[1][layer], new_keys[1]], dim=1))
        assert torch.equal(got_values[1, :, 6], new_values[1, :, 0])
        assert torch.equal(got_keys[0, :, 4:], torch.zeros(HEADS, 3, DIM))  # the null block pads the short row


def test_blocks_are_counted_shared_and_given_back():
    pool = BlockPool(capacity=3, block_size=4)
    cache, mask, _ = prefill([5])
    (prompt,) = write_prompts(pool, cache, mask.sum(-1).tolist())
    pool.share(prompt.blocks)  # a second holder (another row)
    kept = PagedPrompt(pool, list(prompt.blocks), prompt.length)
    assert pool.in_use == 2 and all(pool.is_shared(b) for b in prompt.blocks)
    prompt.release()
    assert pool.in_use == 2 and not pool.is_shared(kept.blocks[0])
    [extra] = pool.allocate(1)
    with pytest.raises(KVPoolExhausted) as info:
        pool.allocate(1)
    assert info.value.fault is Fault.INVALID and info.value.errors == {"kv_blocks_free": 0, "kv_blocks": 3}
    kept.release()
    pool.release([extra])
    assert pool.free == 3 and pool.in_use == 0


def test_named_free_blocks_stay_findable_until_the_pool_needs_them_least_recently_used_first():
    pool = BlockPool(capacity=4, block_size=4)
    a, b, c = pool.allocate(3)
    for block, name in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.name(block, name)
    pool.release([b])
    pool.release([a])  # b was let go first: it goes first
    pool.release([c])
    assert pool.free == 4 and pool.cached == 3 and pool.cached_run([b"a", b"b", b"c"]) == [a, b, c]
    pool.share([a])  # a hit takes a cached block out of the free queue
    assert pool.free == 3
    [fresh] = pool.allocate(1)  # an unnamed free block goes out before any cached one
    assert fresh not in (a, b, c) and pool.cached == 3
    [evicted] = pool.allocate(1)
    assert evicted == b and pool.cached_run([b"b"]) == [] and pool.cached_run([b"a", b"b"]) == [a]
    pool.release([a])
    pool.forget_names()  # new weights: nothing is found again
    assert pool.cached == 0 and pool.cached_run([b"a"]) == []


def test_a_rows_blocks_are_evicted_deepest_first_so_its_shared_start_stays_longest():
    pool = BlockPool(capacity=3, block_size=4)
    row = pool.allocate(3)
    for index, block in enumerate(row):
        pool.name(block, bytes([index]))
    pool.release(row)  # in token order, as a finished row gives its table back
    pool.allocate(1)
    assert pool.cached_run([b"\x00", b"\x01", b"\x02"]) == row[:2]


def test_a_name_keeps_its_first_block_and_the_null_block_is_never_named():
    pool = BlockPool(capacity=3, block_size=4)
    first, second = pool.allocate(2)
    pool.name(first, b"x")
    pool.name(second, b"x")  # the same K/V computed twice: the first stays the one found
    pool.name(NULL_BLOCK, b"y")
    assert pool.cached_run([b"x"]) == [first] and pool.cached_run([b"y"]) == [] and not pool.is_named(second)


def test_blocks_are_handed_out_cleared_whatever_their_last_holder_left():
    pool = BlockPool(capacity=2, block_size=4)
    cache, mask, _ = prefill([3])
    (prompt,) = write_prompts(pool, cache, mask.sum(-1).tolist())
    for layer in (*pool.keys, *pool.values):
        layer[:, prompt.blocks] = float("nan")
    prompt.release()
    blocks = pool.allocate(2)
    for layer in (*pool.keys, *pool.values):
        assert torch.equal(layer[:, blocks], torch.zeros_like(layer[:, blocks]))


def test_a_prompt_written_after_cached_blocks_holds_them_and_its_own_and_a_prefix_is_gathered_back():
    pool = BlockPool(capacity=8, block_size=4)
    cache, mask, keys = prefill([9])
    (whole,) = write_prompts(pool, cache, [9])
    prefix = whole.blocks[:2]  # 8 tokens in two full blocks, found cached by a later request
    pool.share(prefix)
    gathered = prefix_cache(pool, [prefix, []], dtype=torch.float32)
    for layer in range(LAYERS):
        assert gathered.layers[layer].keys.shape == (2, HEADS, 8, DIM)
        assert torch.equal(gathered.layers[layer].keys[0], keys[0][layer][:, :8])
        assert torch.equal(gathered.layers[layer].keys[1], torch.zeros(HEADS, 8, DIM))  # no prefix: the null block
    # The rest (here one token, the last of a 9-token row's cache) goes into a block of its own.
    (extended,) = write_prompts(pool, cache, [9], [prefix])
    assert extended.blocks[:2] == prefix and len(extended.blocks) == 3 and extended.length == 9
    slot = pool.slots(extended.blocks, 8, 9, device="cpu")
    assert torch.equal(flat_slots(pool.keys[0])[:, slot], keys[0][0][:, 8:])
    whole.release()
    extended.release()
    assert pool.in_use == 0


def test_a_failed_write_gives_back_what_it_took():
    pool = BlockPool(capacity=2, block_size=4)
    cache, mask, _ = prefill([4, 8])  # 1 + 2 blocks: the second does not fit
    with pytest.raises(KVPoolExhausted):
        write_prompts(pool, cache, mask.sum(-1).tolist())
    assert pool.in_use == 0


def test_the_decode_mask_shows_each_row_its_cache_and_its_new_token():
    lengths = torch.tensor([1, 3])
    boolean = decode_mask(lengths, 4, attn_implementation="sdpa", dtype=torch.float32)
    assert boolean.shape == (2, 1, 1, 4)
    assert boolean[:, 0, 0].tolist() == [[True, True, False, False], [True, True, True, True]]
    additive = decode_mask(lengths, 4, attn_implementation="eager", dtype=torch.float16)
    assert additive.dtype == torch.float16 and additive[0, 0, 0].tolist()[:2] == [0, 0]
    assert additive[0, 0, 0, 2] == torch.finfo(torch.float16).min
    assert decode_mask(torch.tensor([5, 5]), 6, attn_implementation="sdpa", dtype=torch.float32).all()


def test_the_bytes_a_token_takes_are_those_of_the_models_own_cache(loaded):
    """Sizing the pool by device memory (ROLLOUT_KV_CACHE_MEMORY_FRACTION) counts what the model's
    own forward stores per token: measured on its DynamicCache after a prefill."""
    from engine.paged_kv import kv_bytes_per_token, kv_tokens_for_memory

    ids = torch.tensor([[100, 101, 102, 103, 104]])
    with torch.inference_mode():
        out = loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None) or out.past_key_values
    stored = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    per_token = kv_bytes_per_token(loaded.model.config, loaded.dtype)
    assert per_token * ids.shape[1] == stored
    assert kv_tokens_for_memory(loaded.model.config, loaded.dtype, 1000 * per_token, 0.5) == 500
