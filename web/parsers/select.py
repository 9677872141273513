"""Which parsers read the served model's replies: the setting (vLLM's ``--tool-call-parser`` /
``--reasoning-parser``), or with ``auto`` the markup the model's chat template writes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from web.parsers.reasoning import REASONING_PARSERS, ThinkReasoningParser
from web.parsers.tool import TOOL_PARSERS, MarkerToolParser

AUTO, NONE = "auto", "none"


def template_source(tokenizer) -> str:
    template = tokenizer.chat_template
    return "\n".join(sorted(template.values())) if isinstance(template, dict) else (template or "")


def tool_parser_name(tokenizer, setting: str) -> str | None:
    """The tool-call parser's name, or None: the setting, or what the chat template writes calls as."""
    if setting != AUTO:
        return None if setting == NONE else setting
    source = template_source(tokenizer)
    return next((name for name, cls in TOOL_PARSERS.items() if cls.start in source), None)


def tool_parser(tokenizer, setting: str) -> MarkerToolParser | None:
    name = tool_parser_name(tokenizer, setting)
    return TOOL_PARSERS[name]() if name else None


def reasoning_parser(tokenizer, setting: str, template_kwargs: Mapping[str, Any]) -> ThinkReasoningParser | None:
    """The reasoning parser for one request, or None; a template that reads ``enable_thinking`` is
    Qwen3's (off when the request turns thinking off)."""
    if setting == NONE:
        return None
    if setting == AUTO:
        source = template_source(tokenizer)
        if "</think>" not in source:
            return None
        setting = "qwen3" if "enable_thinking" in source else "deepseek_r1"
    cls = REASONING_PARSERS[setting]
    if cls.follows_enable_thinking and template_kwargs.get("enable_thinking") is False:
        return None
    return cls()
