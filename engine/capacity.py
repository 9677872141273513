"""The GPU worker's running batch in numbers: the check that a request can ever fit it, and the
admission rule that it fits now, under the KV budget at the worst point of every row's future.

Torch-free, so the API can refuse at submit what no GPU worker could ever run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import CapacityError


@dataclass(frozen=True)
class SchedulerLimits:
    max_rows: int = 16  # rows decoding together (ROLLOUT_GPU_BATCH_SIZE)
    kv_cache_tokens: int = 131_072  # rows x width of the running cache, at its worst point
    prefill_chunk_tokens: int = 512  # prefill tokens per step while rows decode
    prompt_cache_tokens: int = 4096  # recent prompts' KV kept for late group members
    encoder_cache_bytes: int = 256 * 1024 * 1024  # vision-encoder outputs by content hash


def check_capacity(limits: SchedulerLimits, prompt_tokens: int, max_tokens: int, n: int) -> None:
    """A request must fit an empty batch: ``n`` rows at most ``max_rows``, and ``n`` rows of
    prompt + max_tokens within the KV budget."""
    if n > limits.max_rows:
        raise CapacityError(f"n={n} rows exceed the GPU batch of {limits.max_rows} rows",
                            errors={"n": n, "max_rows": limits.max_rows})
    need = n * (prompt_tokens + max_tokens)
    if need > limits.kv_cache_tokens:
        raise CapacityError(
            f"{n} x (prompt {prompt_tokens} + max_tokens {max_tokens}) = {need} tokens exceed the KV cache "
            f"budget of {limits.kv_cache_tokens} tokens",
            errors={"kv_cache_tokens_needed": need, "kv_cache_tokens": limits.kv_cache_tokens})


def peak_cache_tokens(rows: Sequence[tuple[int, int]]) -> int:
    """Largest rows x width a left-padded cache reaches for rows ``(length now, steps left)``.

    After t steps the rows with more than t steps left remain, and the cache is as wide as the
    longest of them (finished rows leave and the cache is trimmed); the peak is at some row's last
    step.
    """
    peak = 0
    for _, steps in rows:
        alive = [(length, left) for length, left in rows if left >= steps]
        peak = max(peak, len(alive) * max(length + steps for length, _ in alive))
    return peak


def fits_kv_budget(running: Sequence[tuple[int, int]], joining: Sequence[tuple[int, int, int]], budget: int) -> bool:
    """Whether the cache stays within ``budget`` at its worst point with the ``running`` rows
    (length now, steps left) and every ``joining`` request (prompt tokens, max_tokens, rows)."""
    futures = [*running, *((prompt, steps) for prompt, steps, rows in joining for _ in range(rows))]
    return peak_cache_tokens(futures) <= budget
