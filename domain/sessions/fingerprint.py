"""Whether a chat turn's messages extend the session's last turn: each message reduced to what the
prompt is made of and hashed, so the store keeps a few bytes a message, never the conversation.

What a client may change without changing what the model saw: key order, ``content`` None against
``""`` (as verifiers' prefix match treats them), a list of text parts against their text, a call's
id and type (the sampled text holds neither), its arguments' JSON spacing. The assistant message
the last turn returned matches with or without its ``reasoning_content`` (agents often drop it;
the model's own ids are what the next prompt holds either way)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def _text(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


def canonical(message: dict[str, Any], *, reasoning: bool = True) -> dict[str, Any]:
    """``message`` as it counts for the prompt (see the module's docstring)."""
    out = {k: v for k, v in message.items() if k not in ("content", "tool_calls", "reasoning_content") and v is not None}
    out["content"] = _text(message.get("content"))
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            calls.append({"name": function.get("name"), "arguments": _arguments(function.get("arguments"))})
        else:
            calls.append(call)
    if calls:
        out["tool_calls"] = calls
    if reasoning and message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    return out


def digest(value: Any) -> str:
    data = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.blake2b(data.encode(), digest_size=12).hexdigest()


def message_digests(messages: list[dict[str, Any]]) -> list[str]:
    return [digest(canonical(m)) for m in messages]


def returned_digests(message: dict[str, Any]) -> list[str]:
    """The digests a next turn's copy of a returned assistant message may have: with its reasoning,
    and without it."""
    return sorted({digest(canonical(message)), digest(canonical(message, reasoning=False))})


def context_digest(tools: Any, template_kwargs: dict[str, Any]) -> str:
    """What renders the prompt besides the messages: a turn with other tools or template variables
    is rendered again, not continued."""
    return digest({"tools": tools or None, "kwargs": template_kwargs or {}})


def new_messages(last_messages: list[str], last_returned: list[str], messages: list[dict[str, Any]]) -> list[dict] | None:
    """The messages after the last turn's messages and its returned assistant message, or None when
    ``messages`` do not start with them (or add nothing)."""
    at = len(last_messages)
    if len(messages) <= at + 1 or message_digests(messages[:at]) != last_messages:
        return None
    if digest(canonical(messages[at])) not in last_returned:
        return None
    return messages[at + 1:]
