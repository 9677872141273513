"""Fair scheduling between keys without livelock or starvation (issue #56 item 3), on the table
runner of tests/engine/test_scheduler_policy.py at the scheduler's default limits: admission by
each key's recent use (engine/tenant_usage.py), preemption that keeps a job's tokens and does not
choose a job again before it made progress (engine/preemption.py). Counted in steps, not seconds."""

from __future__ import annotations

from engine.capacity import SchedulerLimits
from engine.paged_kv import BlockPool
from engine.preemption import MAX_PREEMPTIONS, PROGRESS_BEFORE_PREEMPTION
from engine.scheduler import Scheduler
from engine.tenant_usage import TenantUsage
from tests.engine.test_scheduler_policy import TableFacts, TableRunner, request, run_to_end, scheduler


def default_scheduler(**limits) -> Scheduler:
    limits = SchedulerLimits(**limits)
    return Scheduler(TableFacts(), TableRunner(BlockPool(limits.kv_blocks, limits.kv_block_tokens)), limits)


def steps_until(sched: Scheduler, tags: set, trickle=None) -> tuple[int, dict]:
    """Step until every tag in ``tags`` ended; ``trickle(step)`` submits between steps. The steps
    taken, and every request that ended (tag: (its step, Finished))."""
    ended, step = {}, 0
    while not tags <= ended.keys():
        step += 1
        if trickle is not None:
            trickle(step)
        for finished in sched.step():
            assert finished.error is None, finished.error
            ended[finished.tag] = (step, finished)
    return step, ended


def test_a_trickle_of_another_keys_short_jobs_does_not_livelock_a_batch_filling_key():
    """Issue #56: key A fills the 128 rows with two n=64 jobs; key B sends a 2-token job every 40
    steps. Each of B's jobs preempted A's newest job, which ran again from its prompt and was
    preempted again, until B stopped. Now A's job resumes where it was, is not chosen again before
    it made progress, and A ends within 1.5x of its steps alone; each of B's jobs runs at once."""
    alone = default_scheduler()
    for i in range(2):
        alone.submit(request([10 + i] * 8, max_tokens=200, n=64, tenant="a"), tag=f"a{i}")
    alone_steps, _ = steps_until(alone, {"a0", "a1"})

    sched = default_scheduler()
    for i in range(2):
        sched.submit(request([10 + i] * 8, max_tokens=200, n=64, tenant="a"), tag=f"a{i}")
    arrivals, seen = {}, []

    def trickle(step: int) -> None:
        if step % 40 == 0:
            arrivals[f"b{step}"] = step
            sched.submit(request([3] * 8, max_tokens=2, tenant="b"), tag=f"b{step}")
        for job in sched._jobs.values():  # each job's preemptions and its tokens when they happened
            seen.append((job.tag, job.preemptions, job.resume_mark, max(len(r.token_ids) for r in job.rows)))

    trickled_steps, ended = steps_until(sched, {"a0", "a1"}, trickle)
    assert sched.stats.preempted_requests >= 2  # B's jobs did not wait for A's to end
    assert trickled_steps <= 1.5 * alone_steps, (trickled_steps, alone_steps)
    for tag in ("a0", "a1"):  # every token there, none run twice
        assert [c.token_ids for c in ended[tag][1].result.choices] == [
            [(10 + int(tag[1]) + k) % 63 for k in range(1, 201)]] * 64
    a_end = max(ended["a0"][0], ended["a1"][0])
    for tag, arrived in arrivals.items():  # at once (no wait for company while a preempted job waits on
        # it), or, where A's rows had fewer steps left than its 2 tokens, once they end
        if tag in ended:
            assert ended[tag][0] - arrived <= 1 or ended[tag][0] <= a_end + 2, (tag, ended[tag][0], arrived)
    # A job was preempted again only after its rows made PROGRESS_BEFORE_PREEMPTION tokens since it resumed.
    first = {}  # (tag, preemptions): its last resume's mark and its tokens, as it was preempted that time
    for tag, preemptions, mark, tokens in seen:
        first.setdefault((tag, preemptions), (mark, tokens))
    assert max(preemptions for _, preemptions in first) >= 2
    for (_, preemptions), (mark, tokens) in first.items():
        if preemptions >= 2:
            assert tokens - mark >= PROGRESS_BEFORE_PREEMPTION
    run_to_end(sched)
    assert sched.pool.in_use == 0


def test_when_a_whole_batch_job_ends_the_key_that_waited_goes_first():
    """Issue #56 at ROLLOUT_GPU_BATCH_SIZE=32, ROLLOUT_KV_CACHE_TOKENS=16384: key A's bulk of jobs of
    n=32 x 480 tokens (each the whole batch), then key B's 8-token job. The whole-batch job is not
    preempted (A would drop below its share); when it ends both keys hold no rows, and the tie went
    to A's older job, again for every job of the bulk. Now B, which used less lately, goes next."""
    sched = default_scheduler(max_rows=32, kv_cache_tokens=16384)
    for i in range(3):
        sched.submit(request([20 + i] * 16, max_tokens=480, n=32, tenant="a"), tag=f"a{i}")
    for _ in range(10):
        assert sched.step() == []
    sched.submit(request([5] * 16, max_tokens=8, tenant="b"), tag="b")
    _, ended = steps_until(sched, {"a0", "a1", "a2", "b"})
    assert sorted(ended, key=lambda tag: ended[tag][0]) == ["a0", "b", "a1", "a2"]
    assert ended["b"][0] <= ended["a0"][0] + sched.limits.join_wait_steps + 9  # its prefill, then its 8 tokens
    assert sched.stats.preempted_requests == 0 and sched.pool.in_use == 0


def test_a_job_gives_way_only_to_a_job_no_longer_than_what_it_has_left_and_a_bounded_number_of_times():
    sched = scheduler(max_rows=4, kv_cache_tokens=4096)
    for i in (1, 2):
        sched.submit(request([i] * 4, max_tokens=300, n=2, tenant="a"), tag=f"a{i}")
    for _ in range(20):
        sched.step()
    long = sched.submit(request([3] * 4, max_tokens=290, tenant="b"), tag="long")  # a's rows have 280 steps left
    sched.step()
    assert sched.stats.preempted_requests == 0 and sched.running_rows == 4  # it waits for a's rows to end
    sched.abort(long)
    assert [f.tag for f in sched.step()] == ["long"]
    most = {}
    for step in range(270):
        if step % 20 == 0:
            sched.submit(request([5] * 4, max_tokens=2, tenant="b"), tag=f"b{step}")
        sched.step()
        for job in sched._jobs.values():
            most[job.tag] = max(most.get(job.tag, 0), job.preemptions)
    # A trickle of b's short jobs: a's two jobs gave way a bounded number of times each, then b waited.
    assert most["a1"] == most["a2"] == MAX_PREEMPTIONS
    results = run_to_end(sched)
    assert [c.token_ids for c in results["a2"].result.choices] == [[(2 + k) % 63 for k in range(1, 301)]] * 2


def test_a_job_waiting_to_resume_across_a_weight_update_has_its_spans_split_where_it_was_preempted():
    sched = scheduler(max_rows=4)
    sched.submit(request([1] * 4, max_tokens=12, n=2, tenant="a"), tag="a1")
    sched.submit(request([2] * 4, max_tokens=12, n=2, tenant="a"), tag="a2")
    for _ in range(3):
        sched.step()
    sched.submit(request([3] * 4, max_tokens=6, tenant="b"), tag="b")
    assert sched.step() == [] and sched.stats.preempted_requests == 1  # a2 waits with 4 tokens a row
    sched.facts.weight_version = "v2"  # what Engine.update_weights does (test_weight_crossing_policy.py)
    sched.pool.forget_names()
    sched.prefixes.prompt_ends.clear()
    sched.weights_changed()
    choices = run_to_end(sched)["a2"].result.choices
    assert [c.token_ids for c in choices] == [list(range(3, 15))] * 2
    # Its resume computed its rows' KV with the new weights: what they had counts as recomputed.
    assert all(c.kv_recomputed is True for c in choices)
    assert [c.weight_versions for c in choices] == [
        [{"version": "v1", "start": 0, "end": 4}, {"version": "v2", "start": 4, "end": 12}]] * 2


def test_a_keys_use_halves_every_half_life_and_is_forgotten_when_negligible():
    now = [0.0]
    usage = TenantUsage(half_life_s=10.0, clock=lambda: now[0])
    usage.charge("a", 1000)
    usage.charge_rows(["a", "b", "b"])  # one decode step: a's row and b's two
    assert (usage.usage("a"), usage.usage("b"), usage.usage("c")) == (1001, 2, 0)
    now[0] = 10.0
    assert usage.usage("a") == 500.5 and usage.usage("b") == 1
    now[0] = 1000.0
    usage.charge("c", 3)
    assert usage.usage("a") == 0 and len(usage) == 1  # no entry kept for keys with no recent work
