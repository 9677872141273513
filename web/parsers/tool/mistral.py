"""Mistral's tool calls before its v11 tokenizer: ``[TOOL_CALLS]`` and a JSON array of
``{"name": ..., "arguments": {...}}`` (vLLM's ``mistral`` parser, ``mistral_tool_parser.py``, for
that form). The array closes the block; text after it is content."""

from __future__ import annotations

from web.parsers.tool.base import MarkerToolParser


class MistralToolParser(MarkerToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    end = None
    array = True
