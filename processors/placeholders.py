"""Media placeholders in prompts: normalise them in text, expand them in token ids.

Text prompts may mark an image with the generic ``<image>`` sentinel or with the model's native
form (Qwen: ``<|vision_start|><|image_pad|><|vision_end|>``); one regex substitution turns both
into the native form and counts them in the same pass, so counting and replacing never disagree.

Token prompts carry, per image, either one collapsed placeholder token or the run already
expanded to the exact length the image needs (what ``/v1/render`` returns). Expansion keeps an
expanded run as it is and expands a collapsed one, so a placeholder is never expanded twice.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Collection, Mapping, Sequence

from processors.errors import PlaceholderCountError

IMAGE_SENTINEL = "<image>"
SENTINELS = {"image": IMAGE_SENTINEL, "video": "<video>", "audio": "<audio>"}


def media_pattern(forms: Mapping[str, str]) -> re.Pattern[str]:
    """One pattern for every marker in ``forms`` (marker -> native form), longest first."""
    return re.compile("|".join(re.escape(form) for form in sorted(forms, key=len, reverse=True)))


def normalize_media(prompt: str, pattern: re.Pattern[str], forms: Mapping[str, str]) -> tuple[str, int]:
    """``prompt`` with every media marker in its native form, and how many markers it has."""
    return pattern.subn(lambda match: forms[match.group(0)], prompt)


def expand_tokens(
    token_ids: Sequence[int],
    replacements: Sequence[Sequence[int]],
    *,
    placeholder_ids: Collection[int],
    collapsed_id: int | Sequence[int],
    modalities: Sequence[str] | None = None,
    token_modality: Mapping[int, str] | None = None,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Expand each media item's placeholder in ``token_ids`` to its replacement.

    ``replacements[i]`` is the exact token run item ``i`` occupies in the expanded prompt;
    ``placeholder_ids`` are the token ids such runs are made of and ``collapsed_id`` is the one
    token that stands for a whole item when collapsed (one per item when items differ in
    modality: ``<|image_pad|>`` for an image, ``<|video_pad|>`` for a video). Inside a run of
    placeholder tokens, each item in turn takes its full replacement when the run continues with
    exactly it, else one collapsed token. Returns the expanded ids and the ``[start, end)`` range
    of every item, in item order.

    With several modalities (``modalities[i]`` of item ``i``, ``token_modality`` naming the
    modality of every placeholder id), items pair with placeholders per modality, in order: the
    k-th video placeholder is the k-th video, wherever the images are (as HF processors pair them).

    Raises :class:`PlaceholderCountError` when placeholders and items do not pair up.
    """
    count = len(replacements)
    collapsed = [collapsed_id] * count if isinstance(collapsed_id, int) else list(collapsed_id)
    kinds = list(modalities) if modalities is not None else [None] * count
    queues: dict[str | None, deque[int]] = {}
    for index, kind in enumerate(kinds):
        queues.setdefault(kind, deque()).append(index)
    out: list[int] = []
    offsets: list[tuple[int, int] | None] = [None] * count
    found = 0
    pos, end = 0, len(token_ids)
    while pos < end:
        token = token_ids[pos]
        if token not in placeholder_ids:
            out.append(token)
            pos += 1
            continue
        run_end = pos
        while run_end < end and token_ids[run_end] in placeholder_ids:
            run_end += 1
        while pos < run_end:
            kind = token_modality.get(token_ids[pos]) if token_modality is not None else None
            queue = queues.get(kind)
            if not queue:
                extra = 1 + _count_runs(token_ids[run_end:], placeholder_ids)
                raise PlaceholderCountError(
                    placeholders=found + extra, items=count,
                    detail=f"more {kind + ' ' if kind else ''}placeholders than {kind or 'media'} items",
                )
            item = queue.popleft()
            replacement = list(replacements[item])
            if list(token_ids[pos:pos + len(replacement)]) == replacement:
                pos += len(replacement)  # already expanded: keep as is
            elif token_ids[pos] == collapsed[item]:
                pos += 1
            else:
                raise PlaceholderCountError(
                    placeholders=found + 1 + _count_runs(token_ids[run_end:], placeholder_ids),
                    items=count,
                    detail=f"the placeholder run of media item {item} has the wrong length or layout",
                )
            offsets[item] = (len(out), len(out) + len(replacement))
            out.extend(replacement)
            found += 1
    if found != count:
        raise PlaceholderCountError(
            placeholders=found, items=count, detail="fewer placeholders than media items"
        )
    return out, offsets


def _count_runs(token_ids: Sequence[int], placeholder_ids: Collection[int]) -> int:
    runs, inside = 0, False
    for token in token_ids:
        is_placeholder = token in placeholder_ids
        runs += is_placeholder and not inside
        inside = is_placeholder
    return runs
