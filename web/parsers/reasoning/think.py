"""``<think>…</think>`` reasoning, as vLLM's ``deepseek_r1`` and ``qwen3`` reasoning parsers read it
(``vllm/reasoning/basic_parsers.py``, ``qwen3_reasoning_parser.py``): a ``<think>`` the model wrote
first is dropped (newer templates put it in the prompt); the text before ``</think>`` is
reasoning, the rest content; no ``</think>``: all of it is reasoning (cut off while thinking).

``qwen3`` is off when the request sets ``enable_thinking: false``: the template then closes an
empty think block in the prompt and every generated character is content (vLLM's serving layer
does the same through ``prompt_is_reasoning_end``). Qwen3.5's implicit end at
``<tool_call><function=`` (its XML tool format) is not read here.

Like the tool parsers, ``parse`` is a function of the text so far whose parts only grow: a stream
holds back what may still become a marker (text that could begin ``<think>`` at the start, the
first characters of ``</think>`` at the end).
"""

from __future__ import annotations

from typing import NamedTuple

from web.parsers.tool.base import held_prefix


class ReasoningParse(NamedTuple):
    reasoning: str
    content: str


class ThinkReasoningParser:
    name = "deepseek_r1"
    start = "<think>"
    end = "</think>"
    # Whether ``chat_template_kwargs.enable_thinking: false`` turns the parser off.
    follows_enable_thinking = False

    def parse(self, text: str, *, final: bool = True) -> ReasoningParse:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start):]
        elif not final and self.start.startswith(stripped):  # nothing yet, or what may be <think>
            return ReasoningParse("", "")
        else:
            body = text
        close = body.find(self.end)
        if close >= 0:
            return ReasoningParse(body[:close], body[close + len(self.end):])
        return ReasoningParse(body if final else body[:len(body) - held_prefix(body, self.end)], "")


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    follows_enable_thinking = True
