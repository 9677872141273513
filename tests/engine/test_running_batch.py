"""The running batch keeps its rows, their jobs and the left-padded cache aligned through joins,
decode steps and departures (engine/running_batch.py): no model, a real DynamicCache of random
tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import Qwen2Config

from engine.decoding import RowDecoder
from engine.kv_batch import PromptKV
from engine.prompt_cache import PrefilledPrompt
from engine.running_batch import RunningBatch
from engine.sampling_params import SamplingParams

CONFIG = Qwen2Config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=8)


def prompt(length: int, rope_delta: int | None = None) -> PrefilledPrompt:
    layers = [(torch.randn(1, 2, length, 4), torch.randn(1, 2, length, 4)) for _ in range(2)]
    return PrefilledPrompt(PromptKV(layers), torch.zeros(16), rope_delta, length)


def row(max_tokens: int = 8) -> RowDecoder:
    return RowDecoder(0, 0, SamplingParams(max_tokens=max_tokens, temperature=0), None)


def join(batch: RunningBatch, prompts: list[PrefilledPrompt], tokens: list[int]) -> list[RowDecoder]:
    rows = [row() for _ in prompts]
    jobs = [SimpleNamespace(prompt_len=p.length) for p in prompts]
    batch.join(rows, jobs, prompts, torch.tensor(tokens), config=CONFIG, device="cpu")
    return rows


def test_rows_that_join_are_left_padded_and_start_at_their_own_positions():
    batch = RunningBatch()
    first = prompt(3)
    join(batch, [first, prompt(5)], [11, 12])
    assert len(batch) == 2 and batch.mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.positions.tolist() == [3, 5] and batch.last.tolist() == [11, 12] and batch.deltas is None
    keys = batch.cache.layers[0].keys
    assert keys.shape == (2, 2, 5, 4) and torch.equal(keys[0, :, 2:], first.kv.layers[0][0][0])
    # An M-RoPE row joins: rows without a delta get 0.
    join(batch, [prompt(2, rope_delta=-7)], [13])
    assert batch.deltas.tolist() == [0, 0, -7] and batch.positions.tolist() == [3, 5, 2]
    assert batch.mask.shape == (3, 5) and batch.mask[2].tolist() == [0, 0, 0, 1, 1]


def test_a_decode_step_feeds_each_rows_last_token_at_its_next_position():
    batch = RunningBatch()
    join(batch, [prompt(3), prompt(4, rope_delta=2)], [11, 12])
    inputs = batch.decode_inputs()
    assert inputs["input_ids"].tolist() == [[11], [12]]
    assert inputs["attention_mask"].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # M-RoPE: text positions, then the three rotary axes shifted by each row's delta.
    assert inputs["position_ids"].shape == (4, 2, 1)
    assert inputs["position_ids"][:, :, 0].tolist() == [[3, 4], [3, 6], [3, 6], [3, 6]]
    batch.advance(batch.cache, inputs["attention_mask"], torch.tensor([21, 22]))
    assert batch.positions.tolist() == [4, 5] and batch.last.tolist() == [21, 22]


def test_finished_rows_leave_and_the_cache_shrinks_to_the_longest_live_row():
    batch = RunningBatch()
    short, long, middle = join(batch, [prompt(2), prompt(6), prompt(4)], [1, 2, 3])
    long.abort()
    batch.drop_finished()
    assert batch.rows == [short, middle] and [job.prompt_len for job in batch.jobs] == [2, 4]
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]] and batch.cache.layers[1].keys.shape[2] == 4
    assert batch.positions.tolist() == [2, 4] and batch.last.tolist() == [1, 3]
    assert batch.futures() == [(2, 8), (4, 8)]
    short.abort()
    middle.abort()
    batch.drop_finished()
    assert len(batch) == 0 and batch.cache is None and batch.positions is None
