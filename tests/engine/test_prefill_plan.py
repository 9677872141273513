"""Which admitted prompts one step prefills (engine/prefill_plan.py): cached prompts join at once,
a shared prompt is computed once, a forward holds at most the budget while rows decode, and a
prompt too long for it alone is chunked without splitting a media item; new prompts wait for company
while a busy batch decodes."""

from __future__ import annotations

from types import SimpleNamespace

from engine.prefill_plan import chunk_end, hold_joins, plan_prefill, reusable_blocks


def job(key: str, length: int, state: str = "admitted"):
    return SimpleNamespace(key=key, compute_len=length, state=state)


def nothing_cached(job):
    return None


def test_cached_prompts_join_now_and_a_shared_prompt_is_one_group():
    a1, a2, b, cached = job("a", 10), job("a", 10), job("b", 20), job("c", 30)
    looked_up = []

    def find_cached(j):
        looked_up.append(j)
        return "C" if j.key == "c" else None

    plan = plan_prefill([a1, cached, a2, b], find_cached, budget=None)
    assert plan.cached == [(cached, "C")]
    assert plan.groups == {"a": [a1, a2], "b": [b]}
    assert plan.taken == [a1, cached, a2, b] and plan.chunked is None
    assert looked_up == [a1, cached, b]  # a2's prompt is a1's: computed once, not looked up


def test_the_budget_counts_the_tokens_a_prompt_computes_after_its_cached_blocks():
    long_history = job("a", 30)  # a 1,000-token prompt whose first 970 tokens are cached blocks
    plan = plan_prefill([long_history, job("b", 200)], nothing_cached, budget=400)
    assert plan.chunked is None and plan.groups.keys() == {"a", "b"}


def test_while_rows_decode_a_forward_holds_at_most_the_budget():
    first, second, third = job("a", 100), job("b", 200), job("c", 50)
    plan = plan_prefill([first, second, third], nothing_cached, budget=400)
    # 2 rows x 200 wide = 400 fit; a third row makes 3 x 200: it waits for the next step.
    assert plan.groups == {"a": [first], "b": [second]} and plan.taken == [first, second]
    assert plan_prefill([first, second, third], nothing_cached, budget=None).groups.keys() == {"a", "b", "c"}


def test_a_prompt_too_long_for_the_budget_alone_is_chunked_one_behind_others_waits():
    long = job("long", 1000)
    plan = plan_prefill([long, job("b", 10)], nothing_cached, budget=512)
    assert plan.chunked is long and plan.groups == {} and plan.taken == [long]
    short = job("a", 10)
    plan = plan_prefill([short, long], nothing_cached, budget=512)
    assert plan.chunked is None and plan.groups == {"a": [short]} and plan.taken == [short]


def test_ended_jobs_are_taken_off_without_prefill():
    done = job("a", 10, state="done")
    plan = plan_prefill([done], nothing_cached, budget=None)
    assert plan.taken == [done] and plan.groups == {} and plan.cached == []


def test_a_chunk_never_ends_inside_a_media_item():
    assert chunk_end(0, 1000, 256, [], media_in_one_forward=False) == 256
    assert chunk_end(768, 1000, 256, [], media_in_one_forward=False) == 1000
    assert chunk_end(0, 1000, 256, [(200, 300)], media_in_one_forward=False) == 300
    assert chunk_end(300, 1000, 256, [(200, 300)], media_in_one_forward=False) == 556
    # A model that takes its pixels in one forward gets every placeholder in the first chunk.
    assert chunk_end(0, 1000, 256, [(100, 150), (600, 700)], media_in_one_forward=True) == 700


def test_new_prompts_wait_for_company_only_while_a_batch_decodes_and_not_for_long():
    def hold(running, joining, waited=0):
        return hold_joins(running=running, joining=joining, waited_steps=waited, ratio=0.5, max_wait_steps=4)

    assert not hold(0, 1)  # nothing decodes: a lone job starts at once
    assert not hold(1, 1) and not hold(3, 1)  # a small batch: each joins at once
    assert hold(15, 1) and hold(15, 6) and not hold(15, 7)  # half the running rows' worth joins together
    assert hold(15, 1, waited=3) and not hold(15, 1, waited=4)  # but waits at most max_wait_steps
    assert not hold_joins(running=15, joining=1, waited_steps=0, ratio=0.0, max_wait_steps=4)  # ratio 0: off


def test_a_prefill_starts_after_the_cached_blocks_it_may_use():
    # At least the last token is computed: a 32-token prompt in two cached blocks reuses one.
    assert reusable_blocks(2, 16, 32, []) == 1 and reusable_blocks(2, 16, 33, []) == 2
    assert reusable_blocks(5, 16, 40, []) == 2  # never more than it found, nor past its length
    # Media wholly inside the cached blocks: the rest is text. Media after them, or across their
    # end: the rest starts before the first item, so it holds all of the prompt's media.
    assert reusable_blocks(4, 16, 100, [(3, 20)]) == 4
    assert reusable_blocks(4, 16, 100, [(3, 20), (40, 70)]) == 0
    assert reusable_blocks(4, 16, 100, [(40, 70)]) == 2
    assert reusable_blocks(4, 16, 100, [(60, 70)]) == 3
