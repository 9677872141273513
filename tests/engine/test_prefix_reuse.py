"""Prefix reuse (engine/prefix_hash.py, engine/paged_kv.py, engine/scheduler.py): KV blocks found
again by name across requests, turns and prompt groups, each request's numbers those it gets on
an engine that reuses nothing; never across cache scopes or weights."""

from __future__ import annotations

import dataclasses

import pytest

from engine.generation import GenerationRequest
from engine.prefix_hash import MediaSpan, prompt_hashes, root_hash
from tests.engine.test_scheduler import assert_same_row, sampled

SIZE = 16


def test_a_blocks_name_holds_its_prefix_its_media_its_scope_and_the_weights():
    ids = list(range(100, 150))  # three full blocks and a partial one
    base = prompt_hashes("key_a", "v1", ids, SIZE, [])
    assert len(base.full) == 3 and base.tail is not None and base.last == base.tail
    longer = prompt_hashes("key_a", "v1", [*ids, *range(7, 40)], SIZE, [])
    assert longer.full[:3] == base.full and longer.full[3] != base.tail  # a shared prefix, named alike
    edited = prompt_hashes("key_a", "v1", [1, *ids[1:]], SIZE, [])
    assert not set(edited.full) & set(base.full)  # a change names every block after it anew
    for other in (prompt_hashes("key_b", "v1", ids, SIZE, []), prompt_hashes("key_a", "v2", ids, SIZE, [])):
        assert not set(other.full) & set(base.full)
    image = prompt_hashes("key_a", "v1", ids, SIZE, [MediaSpan(20, 36, "image:aaa")])
    other_image = prompt_hashes("key_a", "v1", ids, SIZE, [MediaSpan(20, 36, "image:bbb")])
    assert image.full[0] == base.full[0]  # before the media: the same
    assert image.full[1] != other_image.full[1] and image.full[2] != other_image.full[2]
    aligned = prompt_hashes("key_a", "v1", ids[:48], SIZE, [])
    assert aligned.tail is None and aligned.last == aligned.full[-1] == base.full[2]
    assert prompt_hashes("", "v1", [], SIZE, []).last == root_hash("", "v1")


@pytest.fixture(scope="module")
def qwen(models):
    return models("qwen2_vl")


def cold(model, requests):
    """The requests on an engine that reuses nothing."""
    engine = model.engine(prefix_caching=False)
    return [engine.generate([request])[0] for request in requests]


def test_an_agents_turns_compute_only_what_each_turn_added(qwen):
    """Three agents, four turns each, their turns submitted together: a turn's prompt is the last
    turn's prompt, its completion and a tool's answer. Each turn finds the blocks the last one
    computed, by prefill and by decoding, and its numbers are those of a cold engine."""
    engine = qwen.engine()
    tool = qwen.text(" The tool answered: 42 apples and 17 pears were counted in the basket.")
    prompts = [qwen.text(text) for text in ("Plan a trip to the sea.", "Write a poem about rain and umbrellas.",
                                            "Count the fruit in the basket, step by step, and report the total.")]
    image = qwen.image((84, 84), "green")
    prompts[1] = qwen.request("Describe the picture, then plan.", sampled(0), image).prompt_token_ids
    media = [None, image, None]
    computed = ideal = 0
    before = None
    for turn in range(4):
        requests = [GenerationRequest(p, sampled(seed=10 * turn + i, max_tokens=12), mm_kwargs=media[i])
                    for i, p in enumerate(prompts)]
        start = engine.stats.prefill_tokens
        results = engine.generate(requests)
        computed += engine.stats.prefill_tokens - start
        for request, result, want in zip(requests, results, cold(qwen, requests), strict=True):
            assert_same_row(want, result)
            if before is not None:  # the last turn's prompt and completion, less its last token, in full blocks
                held = len(before[requests.index(request)]) - 1
                assert result.cached_tokens == min(held, len(request.prompt_token_ids) - 1) // SIZE * SIZE
        added = [len(p) - (len(before[i]) if before else 0) for i, p in enumerate(prompts)]
        ideal += sum(added)
        before = [[*p, *r.choices[0].token_ids] for p, r in zip(prompts, results, strict=True)]
        prompts = [[*b, *tool] for b in before]
    assert computed <= ideal + 4 * 3 * SIZE  # at most a block's worth more per turn and agent


def test_prompts_with_and_without_cached_blocks_and_media_on_either_side_share_one_forward(qwen):
    """One prefill forward of rows that start at different cached lengths (none, one block,
    several), media in the cached part or after it: each row is what it is alone on a cold engine."""
    engine = qwen.engine(prefill_chunk_tokens=10_000)
    system = qwen.text("You are a careful assistant who answers in one short sentence. " * 3)
    image = qwen.image((64, 48), "red")
    image_first = qwen.request("Describe it briefly.", sampled(1), image).prompt_token_ids
    engine.generate([GenerationRequest(system, sampled(1, max_tokens=1)),
                     GenerationRequest([*image_first, *qwen.text(" And more.")], sampled(1, max_tokens=1),
                                       mm_kwargs=image)])
    requests = [
        GenerationRequest([*system, *qwen.text(" What is rain?")], sampled(2)),  # cached text, text after
        GenerationRequest([*system, *image_first], sampled(3), mm_kwargs=image),  # cached text, media after
        GenerationRequest([*image_first, *qwen.text(" And more. Then count.")], sampled(4), mm_kwargs=image),
        GenerationRequest(qwen.text("A fresh prompt nobody sent before."), sampled(5)),  # nothing cached
    ]
    forwards = engine.stats.prefill_forwards
    results = engine.generate(requests)
    assert engine.stats.prefill_forwards == forwards + 1
    assert [r.cached_tokens for r in results] == [len(system) // SIZE * SIZE, len(system) // SIZE * SIZE,
                                                  (len(image_first) + 4) // SIZE * SIZE, 0]
    assert results[2].cached_tokens > 0
    for result, want in zip(results, cold(qwen, requests), strict=True):
        assert_same_row(want, result)


def test_a_long_prompt_after_cached_blocks_is_chunked_from_their_end(qwen):
    engine = qwen.engine(prefill_chunk_tokens=64)
    history = qwen.text("The river runs to the sea and the sea runs to the sky. " * 12)
    engine.generate([GenerationRequest(history, sampled(1, max_tokens=1))])
    long = GenerationRequest([*history, *qwen.text(" Summarize all of it. " * 20)], sampled(2))
    busy = GenerationRequest(qwen.text("Keep decoding meanwhile."), sampled(3, max_tokens=30))
    scheduler = engine.scheduler()
    scheduler.submit(busy, tag="busy")
    scheduler.step()
    forwards = engine.stats.prefill_forwards
    scheduler.submit(long, tag="long")
    ended = {}
    while scheduler.has_work:
        ended.update({f.tag: f for f in scheduler.step()})
    computed = len(long.prompt_token_ids) - len(history) // SIZE * SIZE
    assert ended["long"].result.cached_tokens == len(history) // SIZE * SIZE
    assert engine.stats.prefill_forwards - forwards == -(-computed // 64)  # chunks of the rest only
    for tag, request in (("long", long), ("busy", busy)):
        assert_same_row(cold(qwen, [request])[0], ended[tag].result)


def test_blocks_are_never_found_across_cache_scopes(qwen):
    engine = qwen.engine()
    history = qwen.text("A shared system prompt that two tenants happen to send word for word, twice over.")

    def request(scope, seed):
        return dataclasses.replace(GenerationRequest([*history, *qwen.text(f" Question {seed}?")], sampled(seed)),
                                   cache_scope=scope)

    engine.generate([request("key_a", 1)])
    assert engine.generate([request("key_b", 2)])[0].cached_tokens == 0
    assert engine.generate([request("key_a", 3)])[0].cached_tokens >= len(history) // SIZE * SIZE > 0


def test_cached_blocks_make_way_least_recently_used_when_the_pool_needs_them(qwen):
    engine = qwen.engine(kv_cache_tokens=12 * SIZE, max_rows=4)
    first = qwen.text("The first history, long enough to fill a few blocks of sixteen tokens each, at least.")
    again = GenerationRequest([*first, *qwen.text(" Go on.")], sampled(3))
    engine.generate([GenerationRequest(first, sampled(1, max_tokens=1))])
    assert engine.generate([again])[0].cached_tokens == len(first) // SIZE * SIZE
    second = qwen.text("A second history, of other words, that takes the pool's room when the first is idle.")
    engine.generate([GenerationRequest(second, sampled(2, max_tokens=12 * SIZE - len(second)))])  # every block
    assert engine.generate([again])[0].cached_tokens == 0  # evicted: computed again, and still right
    assert_same_row(cold(qwen, [again])[0], engine.generate([again])[0])
    assert engine.kv_pool.in_use == 0


def test_new_weights_find_nothing_the_old_ones_computed(qwen, tmp_path):
    engine = qwen.engine()
    history = qwen.text("Weights change between RL steps; their old KV must never be reused by the new.")
    request = GenerationRequest([*history, *qwen.text(" Next.")], sampled(1))
    engine.generate([request])
    assert engine.generate([request])[0].cached_tokens > 0 and engine.kv_pool.cached > 0
    engine.save_weights(tmp_path / "same")
    engine.update_weights(tmp_path / "same", weight_version="step-2")
    assert engine.kv_pool.cached == 0 and len(engine.prompt_ends) == 0
    assert engine.generate([request])[0].cached_tokens == 0


def test_prefix_caching_off_reuses_nothing_but_a_prompt_shared_in_one_step(qwen):
    engine = qwen.engine(prefix_caching=False)
    request = GenerationRequest(qwen.text("The same prompt, twice in one call and once more later."), sampled(1))
    together = engine.generate([request, dataclasses.replace(request, sampling=sampled(2))])
    assert [r.cached_tokens for r in together] == [0, len(request.prompt_token_ids)]
    assert engine.generate([request])[0].cached_tokens == 0 and engine.kv_pool.cached == 0
