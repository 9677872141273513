"""Reasoning parsers by name (vLLM's ``--reasoning-parser`` names). ``tests/web/parsers``
enumerates this registry; a new one's name goes into ``domain/settings.py``'s choices too."""

from __future__ import annotations

from web.parsers.reasoning.think import Qwen3ReasoningParser, ReasoningParse, ThinkReasoningParser

REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    cls.name: cls for cls in (ThinkReasoningParser, Qwen3ReasoningParser)}

__all__ = ["REASONING_PARSERS", "ReasoningParse", "ThinkReasoningParser"]
