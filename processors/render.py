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

from engine.errors import InvalidRequestError
from processors.base import MultimodalProcessor
from processors.cache import MultimodalCache
from processors.finalize import split_items
from processors.pipeline import PreprocessLimits, _Run


def render(
    messages: Sequence[Mapping[str, Any]],
    processor: MultimodalProcessor,
    *,
    fetcher: Any,
    cache: MultimodalCache | None = None,
    limits: PreprocessLimits | None = None,
    options: Mapping[str, Any] | None = None,
) -> dict[str, list]:
    """``{"token_ids": [...], "content_parts": [...]}`` for OpenAI-style chat ``messages``:
    ``{"role": ..., "content": str | [{"type": "text", "text": ...},
    {"type": "image_url", "image_url": {"url": ...}, "uuid"?: ...}]}``."""
    chat, content_parts = template_messages(messages)
    text = processor.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    with _Run(processor, fetcher, cache, limits or PreprocessLimits(), dict(options or {})) as run:
        # The template already wrote any special tokens the model wants: add none.
        token_ids, bundles = run.layout({"prompt": text, "content_parts": content_parts}, add_special_tokens=False)
        if cache is not None:
            run.store(split_items(bundles, processor))
    return {"token_ids": token_ids, "content_parts": content_parts}


def template_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[dict]]:
    """Messages the way HF chat templates read them (an image is ``{"type": "image"}``), and
    the images as job ``content_parts``, in order."""
    if not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out, parts = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a role")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of parts")
        converted = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                converted.append({"type": "text", "text": part["text"]})
            elif kind == "image_url" and isinstance(part.get("image_url"), Mapping) \
                    and isinstance(part["image_url"].get("url"), str):
                converted.append({"type": "image"})
                parts.append({"type": "image_url", "url": part["image_url"]["url"],
                              **({"uuid": part["uuid"]} if part.get("uuid") is not None else {})})
            else:
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}] must be a text part or an image_url part with a url"
                )
        out.append({"role": message["role"], "content": converted})
    return out, parts
