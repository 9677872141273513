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
from collections.abc import Collection, Sequence

from processors.errors import PlaceholderCountError

IMAGE_SENTINEL = "<image>"


def sentinel_pattern(native: str) -> re.Pattern[str]:
    """The pattern :func:`normalize_text` uses: the native form or the sentinel, longest first."""
    forms = sorted({native, IMAGE_SENTINEL}, key=len, reverse=True)
    return re.compile("|".join(re.escape(form) for form in forms))


def normalize_text(prompt: str, pattern: re.Pattern[str], native: str) -> tuple[str, int]:
    """``prompt`` with every image marker in ``native`` form, and how many markers it has."""
    return pattern.subn(lambda _: native, prompt)


def expand_tokens(
    token_ids: Sequence[int],
    replacements: Sequence[Sequence[int]],
    *,
    placeholder_ids: Collection[int],
    collapsed_id: int,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Expand each image's placeholder in ``token_ids`` to its replacement.

    ``replacements[i]`` is the exact token run image ``i`` occupies in the expanded prompt;
    ``placeholder_ids`` are the token ids such runs are made of and ``collapsed_id`` is the one
    token that stands for a whole image when collapsed. Inside a run of placeholder tokens, each
    image in turn takes its full replacement when the run continues with exactly it, else one
    collapsed token. Returns the expanded ids and the ``[start, end)`` range of every image.

    Raises :class:`PlaceholderCountError` when placeholders and images do not pair up.
    """
    out: list[int] = []
    offsets: list[tuple[int, int]] = []
    image = 0
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
            if image == len(replacements):
                extra = 1 + _count_runs(token_ids[run_end:], placeholder_ids)
                raise PlaceholderCountError(
                    placeholders=image + extra, items=len(replacements),
                    detail="more placeholders than media items",
                )
            replacement = list(replacements[image])
            if list(token_ids[pos:pos + len(replacement)]) == replacement:
                pos += len(replacement)  # already expanded: keep as is
            elif token_ids[pos] == collapsed_id:
                pos += 1
            else:
                raise PlaceholderCountError(
                    placeholders=image + 1 + _count_runs(token_ids[run_end:], placeholder_ids),
                    items=len(replacements),
                    detail=f"the placeholder run of media item {image} has the wrong length or layout",
                )
            offsets.append((len(out), len(out) + len(replacement)))
            out.extend(replacement)
            image += 1
    if image != len(replacements):
        raise PlaceholderCountError(
            placeholders=image, items=len(replacements), detail="fewer placeholders than media items"
        )
    return out, offsets


def _count_runs(token_ids: Sequence[int], placeholder_ids: Collection[int]) -> int:
    runs, inside = 0, False
    for token in token_ids:
        is_placeholder = token in placeholder_ids
        runs += is_placeholder and not inside
        inside = is_placeholder
    return runs
