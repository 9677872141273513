"""The model runner (engine/model_runner.py) alone: the forwards the scheduler decides on, on the
demo model, no scheduler. A prompt prefilled after cached blocks, beside one with none, gives the
numbers and the K/V of a cold prefill; a forward that raises gives the cached blocks back."""

from __future__ import annotations

import pytest
import torch

from engine.encoder_cache import EncoderCache
from engine.model_runner import ModelRunner
from engine.paged_kv import BlockPool, flat_slots
from engine.scheduler import EngineStats
from engine.step_runner import PromptInput


@pytest.fixture
def runner(loaded):
    return ModelRunner(loaded, BlockPool(64, 16), EncoderCache(0), EngineStats())


def keys_of(pool: BlockPool, blocks: list[int], length: int) -> torch.Tensor:
    return flat_slots(pool.keys[0])[:, pool.slots(blocks, 0, length, device="cpu")]


def test_a_prompt_after_cached_blocks_is_what_a_cold_prefill_gives(runner, prompts):
    long = prompts.text("The river runs to the sea and the sea runs to the sky, again and again and again.")
    other = prompts.text("A fresh prompt.")
    [cold] = runner.prefill([PromptInput(long, {}, [])])
    prefix = cold.kv.blocks[:2]
    runner.pool.share(prefix)
    warm, fresh = runner.prefill([PromptInput(long, {}, [], prefix, 32), PromptInput(other, {}, [])])
    assert warm.kv.blocks[:2] == prefix and len(warm.kv.blocks) == len(cold.kv.blocks)
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(keys_of(runner.pool, warm.kv.blocks, len(long)),
                               keys_of(runner.pool, cold.kv.blocks, len(long)), atol=1e-5, rtol=0)
    [alone] = runner.prefill([PromptInput(other, {}, [])])
    torch.testing.assert_close(fresh.logits, alone.logits, atol=1e-5, rtol=0)
    assert runner.stats.prefill_forwards == 3


def test_a_prefill_that_raises_gives_its_cached_blocks_back(runner, prompts):
    ids = prompts.text("Some words to fill more than two blocks of sixteen tokens each, and a few more.")
    [done] = runner.prefill([PromptInput(ids, {}, [])])
    done.kv.release()
    prefix = runner.pool.allocate(2)  # held as a found prefix is
    beyond = [*ids[:-1], runner.loaded.vocab_size + 5]  # the embedding raises (the engine checks ids before)
    bad = PromptInput(beyond, {}, [], prefix, 32)
    with pytest.raises(IndexError):
        runner.prefill([bad])
    assert bad.prefix == [] and runner.pool.in_use == 0
