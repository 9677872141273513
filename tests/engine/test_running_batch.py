"""The running batch keeps its rows, their jobs and their block tables aligned through joins,
decode steps and departures (engine/running_batch.py): no model, a real KV pool, prompts written
from random tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.decoding import RowDecoder
from engine.paged_kv import BlockPool, PagedPrompt
from engine.prompt_cache import PrefilledPrompt
from engine.running_batch import RunningBatch
from engine.sampling_params import SamplingParams

SIZE = 4


def prompt(pool: BlockPool, length: int, rope_delta: int | None = None) -> PrefilledPrompt:
    layers = [(torch.randn(2, length, 4), torch.randn(2, length, 4)) for _ in range(2)]
    return PrefilledPrompt(PagedPrompt(pool, pool.write_prompt(layers), length), torch.zeros(16), rope_delta, length)


def row(max_tokens: int = 8) -> RowDecoder:
    return RowDecoder(0, 0, SamplingParams(max_tokens=max_tokens, temperature=0), None)


def join(batch: RunningBatch, prompts: list[PrefilledPrompt], tokens: list[int], job=None) -> list[RowDecoder]:
    rows = [row() for _ in prompts]
    jobs = [job or SimpleNamespace(prompt_len=p.length) for p in prompts]
    batch.join(rows, jobs, prompts, torch.tensor(tokens))
    return rows


def test_rows_join_at_their_own_positions_holding_their_prompts_blocks():
    pool = BlockPool(16, SIZE)
    batch = RunningBatch(pool)
    first, second = prompt(pool, 3), prompt(pool, 5)
    join(batch, [first, second], [11, 12])
    assert batch.tables == [first.kv.blocks, second.kv.blocks] and batch.lengths == [3, 5]
    assert batch.last.tolist() == [11, 12] and batch.deltas is None
    # An M-RoPE row joins: rows without a delta get 0.
    join(batch, [prompt(pool, 2, rope_delta=-7)], [13])
    assert batch.deltas == [0, 0, -7] and batch.lengths == [3, 5, 2]


def test_a_decode_step_feeds_each_rows_last_token_at_its_next_position_into_its_next_slot():
    pool = BlockPool(16, SIZE)
    batch = RunningBatch(pool)
    a, b = prompt(pool, 3), prompt(pool, 4, rope_delta=2)
    join(batch, [a, b], [11, 12])
    a.kv.release()
    b.kv.release()  # the rows are now their blocks' only holders
    inputs = batch.decode_inputs()
    assert inputs["input_ids"].tolist() == [[11], [12]]
    # M-RoPE: text positions, then the three rotary axes shifted by each row's delta.
    assert inputs["position_ids"].shape == (4, 2, 1)
    assert inputs["position_ids"][:, :, 0].tolist() == [[3, 4], [3, 6], [3, 6], [3, 6]]
    # Row a writes into its own partial block; row b's block is full, so it took a new one.
    assert len(batch.tables[0]) == 1 and len(batch.tables[1]) == 2
    cache = inputs["cache"]
    assert cache.write_slots.tolist() == [batch.tables[0][0] * SIZE + 3, batch.tables[1][1] * SIZE]
    assert cache.width == 5 and inputs["attention_mask"][:, 0, 0].tolist() == [[True] * 4 + [False], [True] * 5]
    batch.advance(torch.tensor([21, 22]))
    assert batch.lengths == [4, 5] and batch.last.tolist() == [21, 22]


def test_samples_share_their_prompt_and_copy_only_the_partial_block_they_write():
    pool = BlockPool(16, SIZE)
    batch = RunningBatch(pool)
    shared = prompt(pool, 6)  # one full block and a partial one
    full, partial = shared.kv.blocks
    pool.name(full, b"full")
    pool.name(partial, b"tail")  # as the scheduler names a prompt's blocks for later requests
    job = SimpleNamespace(prompt_len=6)
    join(batch, [shared] * 3, [1, 2, 3], job=job)
    shared.kv.release()
    assert pool.in_use == 2  # three samples hold the prompt once
    batch.decode_inputs()
    assert [t[0] for t in batch.tables] == [full] * 3  # the full block stays shared
    assert len({t[1] for t in batch.tables}) == 3 and partial not in {t[1] for t in batch.tables}
    assert torch.equal(pool.keys[0][:, batch.tables[0][1]], pool.keys[0][:, partial])  # a copy, then its own writes
    # The named partial block is never written: free now, and still found by its name.
    assert pool.in_use == 4 and pool.cached_run([b"full", b"tail"]) == [full, partial]
    assert [f.shared_blocks for f in batch.futures()] == [1, 1, 1] and len({f.group for f in batch.futures()}) == 1


def test_a_row_alone_on_a_named_block_writes_in_place_when_no_block_is_free():
    pool = BlockPool(2, SIZE)
    batch = RunningBatch(pool)
    only = prompt(pool, 6)
    full, partial = only.kv.blocks
    pool.name(partial, b"tail")
    join(batch, [only], [1])
    only.kv.release()
    batch.decode_inputs()  # nothing free to copy into: the cache gives the block up
    assert batch.tables == [[full, partial]] and not pool.is_named(partial) and pool.in_use == 2


def test_a_finished_row_is_shown_before_its_blocks_go_back():
    pool = BlockPool(16, SIZE)
    seen = []
    batch = RunningBatch(pool, on_row_done=lambda row, job, blocks, length: seen.append(
        (job.prompt_len, list(blocks), length, pool.in_use)))
    done = prompt(pool, 5)
    blocks = list(done.kv.blocks)
    [finished] = join(batch, [done], [1])
    done.kv.release()
    finished.abort()
    batch.drop_finished()
    assert seen == [(5, blocks, 5, 2)] and pool.in_use == 0


def test_finished_rows_give_their_blocks_back_at_once():
    pool = BlockPool(16, SIZE)
    batch = RunningBatch(pool)
    prompts = [prompt(pool, 2), prompt(pool, 6), prompt(pool, 4)]
    short, long, middle = join(batch, prompts, [1, 2, 3])
    for p in prompts:
        p.kv.release()
    assert pool.in_use == 4
    long.abort()
    batch.drop_finished()
    assert batch.rows == [short, middle] and [job.prompt_len for job in batch.jobs] == [2, 4]
    assert pool.in_use == 2 and batch.lengths == [2, 4] and batch.last.tolist() == [1, 3]
    assert [(f.length, f.steps_left) for f in batch.futures()] == [(2, 8), (4, 8)]
    short.abort()
    middle.abort()
    batch.drop_finished()
    assert len(batch) == 0 and pool.in_use == 0 and batch.last is None
