"""Which admitted prompts this step prefills, and how: the decisions of prefill, apart from the
forwards that carry them out (``engine.scheduler``), so they can be read and tested alone.

- A prompt in the prompt cache is not computed: its jobs join at once.
- Jobs with the same prompt key (token ids, media, weights, owner) form one group: the first
  computes it, the others share it.
- While rows decode, the distinct prompts of one padded forward hold at most ``budget`` tokens
  (rows x width); the first prompt that would pass it waits for the next step, unless it is the
  only one, which is then prefilled alone in chunks of ``budget`` tokens, one chunk per step.
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


def plan_prefill(admitted: Sequence[Any], cached: Callable[[tuple], Any], *, budget: int | None) -> PrefillPlan:
    """The plan for ``admitted`` jobs (each with ``key``, ``prompt_len`` and ``state``), in order,
    while no prompt is being chunked. ``cached(key)`` is the prompt cache's entry or None;
    ``budget`` the tokens of one prefill forward (None: no rows decode, no limit)."""
    plan = PrefillPlan()
    width = 0
    for job in admitted:
        if job.state == "done":
            plan.taken.append(job)
            continue
        if (prompt := cached(job.key)) is not None:
            plan.taken.append(job)
            plan.cached.append((job, prompt))
            continue
        if job.key in plan.groups:
            plan.taken.append(job)
            plan.groups[job.key].append(job)
            continue
        wider = max(width, job.prompt_len)
        if budget is not None and (len(plan.groups) + 1) * wider > budget:
            if not plan.groups:
                plan.taken.append(job)
                plan.chunked = job
            break
        width = wider
        plan.taken.append(job)
        plan.groups[job.key] = [job]
    return plan


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
