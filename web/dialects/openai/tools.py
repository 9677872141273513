"""OpenAI's function tools on chat completions (as OpenAI's API reference and vLLM's
``ChatCompletionRequest`` take them): ``tools`` checked and handed to the chat template,
``tool_choice`` and ``parallel_tool_calls``, the history's assistant ``tool_calls`` as templates
read them, and the parsers that read the reply (``web/parsers``).

``tool_choice`` ``required`` or a named function constrains the reply to calls in the model's own
format with arguments valid against the tools' schemas (:func:`forced_tool_calls`: a
``tool_calls`` structured output, engine/grammar/, read back by the same parser); where no grammar
writes the model's format, a 422 ``tool_choice_unsupported``, never a turn that may not call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.errors import InvalidRequestError
from web.dialects import chat_template
from web.dialects.common import tokenizer
from web.dialects.structured import checked_schema
from web.parsers import select
from web.parsers.message import MessageParsers
from web.parsers.reasoning import REASONING_PARSERS
from web.services import services

MAX_TOOLS = 128  # OpenAI's own bound
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI: letters, digits, underscores, dashes (vLLM: dots too)


class ToolsUnsupportedError(InvalidRequestError):
    """The served model's chat template does not render tools, or no tool-call parser reads its replies."""

    code = "tools_unsupported"


class ToolChoiceUnsupportedError(InvalidRequestError):
    code = "tool_choice_unsupported"


def _bad(where: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {what}", errors={where: [what]})


def checked_tools(body: dict[str, Any], *, tool_choice: bool = True) -> list[dict] | None:
    """The body's ``tools`` for the template (None when it has none), checked in shape and against
    the served model; with ``tool_choice``, the body's ``tool_choice`` and ``parallel_tool_calls`` too."""
    tools = body.get("tools")
    if tool_choice:
        _check_choice(body, bool(tools))
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"must be a list of at most {MAX_TOOLS} tools")
    for i, tool in enumerate(tools):
        _check_tool(tool, f"tools[{i}]")
    tok = tokenizer()
    if not chat_template.reads_tools(tok):
        raise ToolsUnsupportedError("the served model's chat template does not render tools",
                                    errors={"tools": ["the chat template reads no tools"]})
    if tool_choice and body.get("tool_choice") != "none" and \
            select.tool_parser_name(tok, services().settings.tool_call_parser) is None:
        raise ToolsUnsupportedError("no tool-call parser reads the served model's replies (ROLLOUT_TOOL_CALL_PARSER)",
                                    errors={"tools": ["no tool-call parser for this model"]})
    return tools


def _check_tool(tool: Any, where: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(where, 'must be {"type": "function", "function": {...}}')
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not _NAME.match(function["name"]):
        raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, '_', '-' or '.'")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise _bad(f"{where}.function.description", "must be a string")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise _bad(f"{where}.function.parameters", "must be a JSON Schema object")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise _bad(f"{where}.function.strict", "must be a boolean")


def _check_choice(body: dict[str, Any], has_tools: bool) -> None:
    choice = body.get("tool_choice")
    if choice in (None, "none", "auto"):
        if choice == "auto" and not has_tools:
            raise _bad("tool_choice", "auto needs tools")
    elif choice == "required":
        if not has_tools:
            raise _bad("tool_choice", "required needs tools")
    elif isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad("tool_choice", 'a named function is {"type": "function", "function": {"name": ...}}')
        if function["name"] not in {tool.get("function", {}).get("name") for tool in body.get("tools") or []
                                    if isinstance(tool, dict)}:
            raise _bad("tool_choice.function.name", f"{function['name']!r} is not one of the tools")
    else:
        raise _bad("tool_choice", "must be none, auto, required or {type: function, function: {name}}")
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise _bad("parallel_tool_calls", "must be a boolean")


def template_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's arguments as
    an object (OpenAI sends them as a JSON string; templates write ``arguments | tojson``, as vLLM
    hands them over). Arguments that are no JSON object stay the string they are."""
    if not isinstance(calls, list):
        raise _bad(where, "must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}[{i}]", 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
        out.append({**call, "function": {**function, "arguments": arguments if arguments is not None else {}}})
    return out


def reply_parsers(body: dict[str, Any]) -> MessageParsers:
    """What reads this request's reply: the model's reasoning parser, and its tool-call parser when
    the request gave tools and did not turn them off."""
    settings, tok = services().settings, tokenizer()
    reasoning = select.reasoning_parser(tok, settings.reasoning_parser, body.get("chat_template_kwargs") or {})
    tools = None
    if body.get("tools") and body.get("tool_choice") != "none":
        tools = select.tool_parser(tok, settings.tool_call_parser)
    return MessageParsers(reasoning, tools, body.get("parallel_tool_calls") is not False)


# Tool-call parsers whose format xgrammar's structural tags write (its model keys): Hermes'
# <tool_call>{"name", "arguments"}</tool_call> is Qwen3's.
GRAMMAR_FORMATS = {"hermes": "qwen_3"}


def forced_tool_calls(body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``structured_output`` that makes a reply call a tool (``tool_choice`` required: at least
    one of the tools; named: that one), or None. A model whose call format or reasoning no grammar
    writes is a 422 ``tool_choice_unsupported``."""
    choice = body.get("tool_choice")
    if choice != "required" and not isinstance(choice, dict):
        return None
    settings, tok = services().settings, tokenizer()
    form = GRAMMAR_FORMATS.get(select.tool_parser_name(tok, settings.tool_call_parser) or "")
    reasoning = select.reasoning_parser(tok, settings.reasoning_parser, body.get("chat_template_kwargs") or {})
    if form is None or (reasoning is not None and type(reasoning) is not REASONING_PARSERS["qwen3"]):
        raise ToolChoiceUnsupportedError(
            "tool_choice required or named: no grammar writes this model's tool calls; send auto or none",
            errors={"tool_choice": [f"served for the {', '.join(GRAMMAR_FORMATS)} tool-call parser"]})
    for i, tool in enumerate(body["tools"]):  # compiled into the call's grammar: each a JSON Schema
        checked_schema(tool["function"].get("parameters"), f"tools[{i}].function.parameters")
    return {"tool_calls": {"format": form, "tools": body["tools"], "tool_choice": choice,
                           "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
                           "reasoning": "disabled" if reasoning is None else "enabled"}}


def check_tool_answers(messages: list[dict[str, Any]]) -> None:
    """Each ``tool`` message answers a call of the assistant message before its run of tool
    messages: one with ``tool_calls``, and its ``tool_call_id`` among their ids (where the calls
    have ids; a tool message with no ``tool_call_id`` is taken, as templates that write no ids
    read it). Anything else is a 422 naming the message, not a prompt the model never saw."""
    calls: set[str] | None = None  # the ids the running tool messages may answer; None: no call before them
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            made = message.get("tool_calls") or []
            calls = {call["id"] for call in made if isinstance(call.get("id"), str)} if made else None
            if made and len(calls) < len(made):
                calls = set()  # some calls without ids: any answer is theirs
        elif role == "tool":
            answer = message.get("tool_call_id")
            if calls is None:
                raise _bad(f"messages[{i}]", "a tool message answers no call: the assistant message before it "
                                             "has no tool_calls")
            if answer is not None and calls and answer not in calls:
                raise _bad(f"messages[{i}].tool_call_id", f"{answer!r} is not among the preceding assistant's "
                                                          f"tool_calls ({', '.join(sorted(calls))})")
        else:
            calls = None
