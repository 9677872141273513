"""Which admitted prompts this step prefills, and how: the decisions of prefill, apart from the
forwards that carry them out (``engine.scheduler``), so they can be read and tested alone.

- A prompt found whole in the KV pool (every block by name, and its last logits) is not computed:
  its jobs join at once. A prompt whose first blocks are found computes only the rest
  (:func:`reusable_blocks`).
- Jobs with the same prompt key (token ids, media, weights, owner) form one group: the first
  computes it, the others share it.
- While rows decode, the distinct prompts of one padded forward compute at most ``budget`` tokens
  (rows x width); the first prompt that would pass it waits for the next step, unless it is the
  only one, which is then prefilled alone in chunks of ``budget`` tokens, one chunk per step.
- While rows decode, new prompts wait for company (:func:`hold_joins`): rows that free one at a
  time then join a few at a time, one prefill forward for several.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PrefillPlan:
    cached: list[tuple[Any, Any]] = field(default_factory=list)  # (job, its cached prompt): they join now
    groups: dict[tuple, list[Any]] = field(default_factory=dict)  # prompt key -> its jobs, the leader first
    chunked: Any = None  # a job whose prompt is too long for one forward while rows decode
    taken: list[Any] = field(default_factory=list)  # the jobs this plan takes off the admitted list


def plan_prefill(admitted: Sequence[Any], find_cached: Callable[[Any], Any], *, budget: int | None) -> PrefillPlan:
    """The plan for ``admitted`` jobs (each with ``key``, ``state`` and ``compute_len``, the prompt
    tokens it would compute), in order, while no prompt is being chunked. ``find_cached(job)``
    looks the job's prompt up in the KV pool: its whole prefilled prompt, or None (having noted on
    the job the cached blocks its prefill starts from, which changes its ``compute_len``). A job
    whose prompt another job of this plan computes is not looked up. ``budget``: the tokens of one
    prefill forward (None: no rows decode, no limit)."""
    plan = PrefillPlan()
    width = 0
    for job in admitted:
        if job.state == "done":
            plan.taken.append(job)
            continue
        if job.key in plan.groups:
            plan.taken.append(job)
            plan.groups[job.key].append(job)
            continue
        if (prompt := find_cached(job)) is not None:
            plan.taken.append(job)
            plan.cached.append((job, prompt))
            continue
        wider = max(width, job.compute_len)
        if budget is not None and (len(plan.groups) + 1) * wider > budget:
            if not plan.groups:
                plan.taken.append(job)
                plan.chunked = job
            break
        width = wider
        plan.taken.append(job)
        plan.groups[job.key] = [job]
    return plan


def reusable_blocks(found: int, block_size: int, length: int, media_spans: Sequence[tuple[int, int]]) -> int:
    """How many of the ``found`` cached full blocks at a prompt's start its prefill starts from.

    At least one token is computed (its logits start the decoding), and the rest holds all of the
    prompt's media or none: a model takes a media item's features for all of its placeholders in
    one forward, and some (Qwen-VL's rope index, pixel-in-forward models) want every item of the
    request then. So where media lies after the cached blocks, the prefill starts at the block
    boundary before the first item.
    """
    count = min(found, (length - 1) // block_size)
    if media_spans and max(stop for _, stop in media_spans) > count * block_size:
        count = min(count, min(start for start, _ in media_spans) // block_size)
    return count


def hold_joins(*, running: int, joining: int, waited_steps: int, ratio: float, max_wait_steps: int) -> bool:
    """Whether this step's prompts to compute (``joining`` rows) wait for a later step while
    ``running`` rows decode.

    A prefill is a forward of its own beside the decode step, and costs about as much for one short
    prompt as for several (a layer's launches on a GPU, its Python on a CPU). Rows that drifted
    apart free one per step or so; joining each alone pays a forward per job (bench/arrivals.py:
    64 fresh prompts arriving one per step cost 1.6x the CPU of the same 64 at once). So new rows
    join once they are at least ``ratio`` of the running rows, or after ``max_wait_steps`` steps;
    with few rows running (a small batch) that is at once. The rule is text-generation-inference's
    router's (``waiting_served_ratio``, ``max_waiting_tokens``: router/src/infer/v2/scheduler.rs);
    its defaults (0.3, 20 steps) are for long GPU generations, ours (SchedulerLimits: 0.5, 4 steps)
    were the best of a sweep on the demo model's 32-token jobs (README "Configuration").
    """
    return running > 0 and joining < int(running * ratio) and waited_steps < max_wait_steps


def chunk_end(start: int, length: int, chunk_tokens: int, media_spans: Sequence[tuple[int, int]], *,
              media_in_one_forward: bool) -> int:
    """Where the prompt chunk beginning at ``start`` ends: ``chunk_tokens`` on, never inside a
    media item's placeholders, and past all of them when the model takes its pixels in one forward
    (no encoder-outputs seam)."""
    end = min(length, start + chunk_tokens)
    if media_spans and media_in_one_forward:
        end = max(end, max(stop for _, stop in media_spans))
    for first, stop in media_spans:
        if first < end < stop:
            end = stop
    return end
