"""Render chat messages into the exact token ids the engine will use (``/v1/render``).

Messages go through the model's chat template, then through the same placeholder expansion as
a job, so every image's run has the length its features need. Sending the result back as
``token_ids`` with the returned ``content_parts`` reproduces it exactly: an expanded run is kept,
never expanded again. Image sizes decide the runs, so the images are fetched and processed (the
multimodal cache, when given, serves and keeps them, so a job that follows reuses the work).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.limits import Limits
from processors.base import MultimodalProcessor
from processors.cache import MultimodalCache
from processors.chat_messages import template_messages
from processors.finalize import split_items
from processors.pipeline import _Run


def render(
    messages: Sequence[Mapping[str, Any]],
    processor: MultimodalProcessor,
    *,
    fetcher: Any,
    cache: MultimodalCache | None = None,
    limits: Limits | None = None,
    options: Mapping[str, Any] | None = None,
    owner: str | None = None,
) -> dict[str, list]:
    """``{"token_ids": [...], "content_parts": [...]}`` for OpenAI-style chat ``messages``:
    ``{"role": ..., "content": str | [{"type": "text", "text": ...},
    {"type": "image_url", "image_url": {"url": ...}, "uuid"?: ...}, the same for ``video_url`` and
    ``audio_url``, or ``{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}``]}``.
    ``owner``: the API key id, whose uuid cache entries alone are used (as in
    :func:`processors.pipeline.preprocess`)."""
    chat, content_parts = template_messages(messages)
    text = processor.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    with _Run(processor, fetcher, cache, limits or Limits(), dict(options or {}), owner) as run:
        # The template already wrote any special tokens the model wants: add none.
        token_ids, bundles = run.layout({"prompt": text, "content_parts": content_parts}, add_special_tokens=False)
        if cache is not None:
            run.store(split_items(bundles, processor))
    return {"token_ids": token_ids, "content_parts": content_parts}
