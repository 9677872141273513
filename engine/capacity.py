"""The GPU worker's running batch in numbers: the check that a request can ever fit it, and the
admission rule that it fits now, counted in KV blocks (:mod:`engine.paged_kv`) at the worst point
of every row's future.

Torch-free, so the API can refuse at submit what no GPU worker could ever run.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import CapacityError


@dataclass(frozen=True)
class SchedulerLimits:
    max_rows: int = 128  # rows decoding together (ROLLOUT_GPU_BATCH_SIZE; unset: as many 1,024-token rows as the default pool holds)
    kv_cache_tokens: int = 131_072  # the KV pool, in tokens (ROLLOUT_KV_CACHE_TOKENS)
    kv_block_tokens: int = 16  # tokens per KV block (ROLLOUT_KV_BLOCK_TOKENS)
    prefill_chunk_tokens: int = 512  # prefill tokens per step while rows decode
    prompt_cache_tokens: int = 4096  # recent prompts' last logits (a whole-prompt hit needs no forward)
    prefix_caching: bool = True  # KV blocks found again by name across requests (ROLLOUT_PREFIX_CACHING)
    encoder_cache_bytes: int = 256 * 1024 * 1024  # vision-encoder outputs by content hash
    # While rows decode, new prompts are prefilled once they are join_ratio of the running rows, or
    # after join_wait_steps steps (engine.prefill_plan.hold_joins); join_ratio 0: at the first step.
    join_ratio: float = 0.5  # ROLLOUT_JOIN_RATIO
    join_wait_steps: int = 4  # ROLLOUT_JOIN_WAIT_STEPS
    # Admission weighs each key's tokens of the last while (engine.tenant_usage), halved every this many seconds.
    usage_half_life_s: float = 30.0

    @property
    def kv_blocks(self) -> int:
        return max(1, self.kv_cache_tokens // self.kv_block_tokens)


@dataclass(frozen=True)
class RowFuture:
    """One row as admission sees it: the tokens it holds, the steps it may still take, and the
    full prompt blocks it shares with the other rows of its ``group`` (its request)."""

    length: int
    steps_left: int
    group: Hashable
    shared_blocks: int = 0


def request_rows(prompt_tokens: int, max_tokens: int, n: int, group: Hashable, block_size: int) -> list[RowFuture]:
    """The rows of a request not yet prefilled: ``n`` rows of the prompt sharing its full blocks."""
    return [RowFuture(prompt_tokens, max_tokens, group, prompt_tokens // block_size) for _ in range(n)]


def request_peak_blocks(prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """``peak_blocks`` of one request's rows alone, in closed form: its ``n`` rows all peak at their
    last step, holding the prompt's full blocks once and each its own. The API runs this on every
    submitted line, where numpy's per-call cost was 7 % of a 10,000-line batch's intake."""
    shared = prompt_tokens // block_size
    return shared + n * (-(-(prompt_tokens + max_tokens) // block_size) - shared)


def check_capacity(limits: SchedulerLimits, prompt_tokens: int, max_tokens: int, n: int) -> None:
    """A request must fit an empty batch: ``n`` rows at most ``max_rows``, and its rows' blocks at
    their longest (the prompt's full blocks once, each row's own) within the KV pool."""
    if n > limits.max_rows:
        raise CapacityError(f"n={n} rows exceed the GPU batch of {limits.max_rows} rows",
                            errors={"n": n, "max_rows": limits.max_rows})
    need = request_peak_blocks(prompt_tokens, max_tokens, n, limits.kv_block_tokens)
    if need > limits.kv_blocks:
        raise CapacityError(
            f"{n} x (prompt {prompt_tokens} + max_tokens {max_tokens}) needs {need * limits.kv_block_tokens} "
            f"tokens of KV blocks; the KV pool holds {limits.kv_blocks * limits.kv_block_tokens}",
            errors={"kv_cache_tokens_needed": need * limits.kv_block_tokens,
                    "kv_cache_tokens": limits.kv_blocks * limits.kv_block_tokens})


def peak_blocks(rows: Sequence[RowFuture], block_size: int) -> int:
    """The most KV blocks ``rows`` hold at once if every row runs to its last step.

    A row of length L after t more steps holds ceil((L + t) / block size) blocks, its group's
    shared prompt blocks counted once while any row of the group lives; a row leaves after its
    last step. Between two rows' last steps the live set is fixed and every row only grows, so
    the peak is at some row's last step: evaluated there for all rows at once (numpy, rows x
    distinct ends).
    """
    if not rows:
        return 0
    length = np.fromiter((r.length for r in rows), dtype=np.int64, count=len(rows))
    left = np.fromiter((r.steps_left for r in rows), dtype=np.int64, count=len(rows))
    shared = np.fromiter((r.shared_blocks for r in rows), dtype=np.int64, count=len(rows))
    ends = np.unique(left)[:, None]  # (ends, 1)
    alive = left[None, :] >= ends
    own = -(-(length[None, :] + ends) // block_size) - shared[None, :]
    total = (alive * own).sum(axis=1)
    groups: dict[Hashable, tuple[int, int]] = {}
    for row in rows:
        last, blocks = groups.get(row.group, (-1, 0))
        groups[row.group] = (max(last, row.steps_left), max(blocks, row.shared_blocks))
    group_left = np.array([g[0] for g in groups.values()], dtype=np.int64)
    group_shared = np.array([g[1] for g in groups.values()], dtype=np.int64)
    total += ((group_left[None, :] >= ends) * group_shared[None, :]).sum(axis=1)
    return int(total.max())


def next_admission(tenants: Sequence[Hashable], held: Mapping[Hashable, int], usage: Mapping[Hashable, float]) -> int:
    """Which pending request (by its tenant, in arrival order) is admitted next: the first of the
    tenant with the least recent use (``usage``: :class:`engine.tenant_usage.TenantUsage`), then
    the fewest rows held now (``held``: running and admitted rows by tenant), then arrival. A key
    alone takes every row; a key that waited goes ahead of one that just used the batch, also
    when both hold no rows (a bulk key's job that just ended no longer hands the tie to its next
    one). A request that does not fit is waited for, not passed (a large one would otherwise never
    start). Rows already running are not taken back here: :func:`fair_share_victim` says which
    give way to a tenant below its share."""
    best, rank = 0, None
    seen: set[Hashable] = set()
    for index, tenant in enumerate(tenants):
        if tenant in seen:
            continue
        seen.add(tenant)
        mine = (usage.get(tenant, 0.0), held.get(tenant, 0))
        if rank is None or mine < rank:
            best, rank = index, mine
    return best


def dominant_share(rows: int, blocks: int, limits: SchedulerLimits) -> float:
    """A tenant's share of the batch as dominant resource fairness counts it: the larger of its
    fractions of the rows and of the KV pool (its rows' blocks at their peak)."""
    return max(rows / limits.max_rows, blocks / limits.kv_blocks)


def fair_share_victim(waiting: Hashable, need: float, shares: Mapping[Hashable, float],
                      running: Sequence[tuple[Hashable, float]], tenants: int,
                      usage: Mapping[Hashable, float] | None = None) -> int | None:
    """Which running request gives way so that tenant ``waiting``, whose next request (``need``,
    its dominant share) does not fit now, gets an even share of the batch; its index in ``running``
    (each preemptible running request's tenant and share, in admission order), or None.

    ``shares``: each tenant's dominant share now (running and admitted requests); ``tenants``: how
    many have work (running or waiting); ``usage``: each tenant's recent use (none: not weighed). A
    request gives way only when ``waiting`` would stay within an even share with it, the giving
    tenant keeps at least an even share without it and used the batch more lately than ``waiting``:
    the newest request (least work lost) of the tenant holding the most. So a key alone keeps the
    whole batch, and no key is pushed below its share, which keeps two keys from taking turns
    preempting each other. A request larger than an even share waits for rows to end instead."""
    if tenants < 2:
        return None
    even = 1 / tenants
    if shares.get(waiting, 0.0) + need > even:
        return None
    by_share = sorted({t for t, _ in running if t != waiting}, key=lambda t: shares.get(t, 0.0), reverse=True)
    for tenant in by_share:
        if usage is not None and usage.get(tenant, 0.0) <= usage.get(waiting, 0.0):
            continue
        index = max(i for i, (t, _) in enumerate(running) if t == tenant)
        # Its share less the request's is at most what it keeps (a max of sums minus a max of
        # parts): it errs toward no preemption.
        if shares.get(tenant, 0.0) - running[index][1] >= even:
            return index
    return None


def fits_kv_pool(rows: Sequence[RowFuture], blocks: int, block_size: int) -> bool:
    """Whether ``rows`` (the running ones and every one admitted) stay within ``blocks`` at their peak."""
    return peak_blocks(rows, block_size) <= blocks
