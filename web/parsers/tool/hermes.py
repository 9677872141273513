"""Hermes 2 Pro / Qwen2.5 / Qwen3: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``,
one block per call (vLLM's ``hermes`` parser, ``hermes_tool_parser.py``)."""

from __future__ import annotations

from web.parsers.tool.base import MarkerToolParser


class HermesToolParser(MarkerToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
