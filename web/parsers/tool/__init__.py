"""Tool-call parsers by name (vLLM's ``--tool-call-parser`` names): each reads one model family's
markup for calls. Adding a family: a ``MarkerToolParser`` subclass here, its name in
``domain/settings.py``'s ``tool_call_parser`` choices; ``tests/web/parsers`` enumerates this
registry."""

from __future__ import annotations

from web.parsers.tool.base import MarkerToolParser, ParsedCall, ToolParse
from web.parsers.tool.hermes import HermesToolParser
from web.parsers.tool.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[MarkerToolParser]] = {cls.name: cls for cls in (HermesToolParser, MistralToolParser)}

__all__ = ["TOOL_PARSERS", "MarkerToolParser", "ParsedCall", "ToolParse"]
