"""The Responses API's request as a chat completions body (``POST /v1/responses``): its
``input`` (a string, or input items: messages, ``function_call``, ``function_call_output`` and
``reasoning`` items) as chat messages, ``instructions`` as a first system message, the flat
function tools (``{type, name, parameters, strict}``) and ``tool_choice`` as chat's, ``reasoning``
as the template's ``enable_thinking``, ``max_output_tokens`` and ``text.format`` as
``max_tokens`` and ``response_format``. The chat body then runs the chat route's own pipeline
(web/dialects/openai/session_turns.py), so every check and limit is chat's.

Shapes matched (not copied) from OpenAI's API reference and the official client's types
(openai/types/responses/response_create_params.py, response_input_item_param.py)."""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from web.dialects import chat_template
from web.dialects.common import tokenizer

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _bad(where: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {what}", errors={where: [what]})


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive reasoning, assistant message and ``function_call``
    items are one assistant message (its ``reasoning_content``, ``content`` and ``tool_calls``), as
    the chat reply returned them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "must be a string or a non-empty list of input items")
    out: list[dict[str, Any]] = []
    open_turn: dict[str, Any] | None = None  # the assistant message the last items build
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, "must be an input item object")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") != "assistant":
            open_turn = None
            out.append(_message(item, where))
            continue
        if kind == "function_call_output":
            open_turn = None
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}.call_id", "must be a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"),
                                                                                           f"{where}.output")})
            continue
        if kind not in ("message", "function_call", "reasoning"):
            raise _bad(f"{where}.type", "must be message, function_call, function_call_output or reasoning")
        if open_turn is None or (kind == "reasoning" and (open_turn["content"] or open_turn.get("tool_calls"))) \
                or (kind == "message" and (open_turn["content"] or open_turn.get("tool_calls"))):
            open_turn = {"role": "assistant", "content": None}
            out.append(open_turn)
        if kind == "reasoning":
            open_turn["reasoning_content"] = (open_turn.get("reasoning_content") or "") + _reasoning(item, where)
        elif kind == "message":
            open_turn["content"] = _text(item.get("content"), f"{where}.content")
        else:
            open_turn.setdefault("tool_calls", []).append(_call(item, where))
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise _bad(f"{where}.role", "must be user, assistant, system or developer")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise _bad(f"{where}.content[{j}]", "must be an input_text, output_text or input_image (image_url) part")
    return {"role": role, "content": parts}


def _text(content: Any, where: str) -> str:
    """An assistant message's or a tool output's text (its text parts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("output_text", "input_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(where, "must be a string or a list of text parts")


def _reasoning(item: dict[str, Any], where: str) -> str:
    # The model's own reasoning text (content) is what it saw; a summary stands in when that is all.
    for name in ("content", "summary"):
        parts = item.get(name)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise _bad(f"{where}.{name}", "must be a list of {type, text} parts")
            return "".join(p["text"] for p in parts)
    return ""


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise _bad(f"{where}.{name}", "must be a string")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                    "arguments": item["arguments"]}}


def chat_tools(tools: Any) -> list[dict] | None:
    """The flat function tools as chat's ``{type: function, function: {...}}``."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f"tools[{i}].type", "only function tools are served")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                                      if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice", 'must be none, auto, required or {"type": "function", "name": ...}')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: Any) -> dict | None:
    """``text.format`` as chat's ``response_format`` (web/dialects/structured.py compiles it)."""
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else None
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("text.format", "must be {type: text | json_object | json_schema}")
    if form["type"] != "json_schema":
        return {"type": form["type"]}
    return {"type": "json_schema", "json_schema": {k: form[k] for k in ("name", "schema", "strict", "description")
                                                    if form.get(k) is not None}}


def thinking_kwargs(reasoning: Any) -> dict[str, Any]:
    """``reasoning.effort`` as ``enable_thinking`` on a template that reads it (``none``: off)."""
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise _bad("reasoning", "must be {effort, summary}")
    effort = reasoning.get("effort")
    if effort is None or "enable_thinking" not in chat_template.template_variables(tokenizer()):
        return {}
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise _bad("reasoning.effort", "must be none, minimal, low, medium, high or xhigh")
    return {"enable_thinking": effort != "none"}
