"""A chat reply's assistant message from the model's text: ``reasoning_content`` by the reasoning
parser, then ``tool_calls`` out of the rest by the tool-call parser, ``content`` what is left; and
the same as OpenAI's stream deltas (a call's ``index``, ``id``, ``type`` and ``function.name``
first, then ``function.arguments`` fragments).

The stream re-parses the text so far at each delta and sends what grew (``MessageStream``): every
parser's parse only grows with its text, so the deltas add up to the whole text's message.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from web.parsers.reasoning import ThinkReasoningParser
from web.parsers.tool import MarkerToolParser, ParsedCall


@dataclass(frozen=True)
class MessageParsers:
    reasoning: ThinkReasoningParser | None = None
    tools: MarkerToolParser | None = None
    parallel_tool_calls: bool = True  # false: the first call only (vLLM's reading of it)

    def split(self, text: str, *, final: bool) -> tuple[str, str, list[ParsedCall]]:
        """(reasoning, content, calls) of ``text``; not ``final``: only what cannot change."""
        reasoning, rest = "", text
        if self.reasoning is not None:
            parsed = self.reasoning.parse(text, final=final)
            reasoning, rest = parsed.reasoning, parsed.content
        if self.tools is None:
            return reasoning, rest, []
        calls = self.tools.parse(rest, final=final)
        return reasoning, calls.content, calls.calls if self.parallel_tool_calls else calls.calls[:1]


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parsed_message(text: str, parsers: MessageParsers) -> dict[str, Any]:
    """The assistant message of a whole reply text (``content`` None when the parsers took all of
    it, as vLLM answers; an empty reply nothing parsed keeps ``""``, as before there were parsers)."""
    reasoning, content, calls = parsers.split(text, final=True)
    return {"role": "assistant", "content": content if content or not (calls or reasoning) else None,
            "reasoning_content": reasoning or None,
            "tool_calls": [{"id": call_id(), "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}} for call in calls]}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """``tool_calls`` for a turn that ended by itself having made calls (a cut-off one keeps ``length``)."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class MessageStream:
    """One choice's stream: ``feed`` each text delta, ``final`` on its last."""

    parsers: MessageParsers
    text: str = ""
    _sent: dict[str, int] = field(default_factory=lambda: {"reasoning_content": 0, "content": 0})
    _args_sent: list[int] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self._args_sent)

    def feed(self, delta: str, *, final: bool = False) -> dict[str, Any]:
        """The OpenAI delta of what ``delta`` settled (empty when nothing did)."""
        self.text += delta
        reasoning, content, calls = self.parsers.split(self.text, final=final)
        out: dict[str, Any] = {}
        for name, value in (("reasoning_content", reasoning), ("content", content)):
            if len(value) > self._sent[name]:
                out[name] = value[self._sent[name]:]
                self._sent[name] = len(value)
        entries = []
        for index, call in enumerate(calls):
            if index == len(self._args_sent):
                self._args_sent.append(len(call.arguments))
                entries.append({"index": index, "id": call_id(), "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self._args_sent[index]:
                entries.append({"index": index, "function": {"arguments": call.arguments[self._args_sent[index]:]}})
                self._args_sent[index] = len(call.arguments)
        if entries:
            out["tool_calls"] = entries
        return out
