"""A request's structured-output constraint as it travels: checked, canonical, hashable, free of
torch (the API checks it with the rest of the sampling parameters; the job record stores it as
the request gave it and the GPU worker compiles it, ``engine.grammar.compiler``).

The native shape is one key of ``{json_schema, json_object, regex, choice, grammar, tool_calls}``
(vLLM's ``structured_outputs`` names its ``json`` ``json_schema`` here); every dialect maps onto
it; chat's ``tool_choice`` required or named makes a ``tool_calls`` one (web/dialects/openai/tools.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.grammar.errors import GrammarTooComplexError, InvalidGrammarError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls")
# tool_calls: calls in a model family's own format (xgrammar's structural tags: ``format`` is one of
# its model keys, e.g. qwen_3 for Hermes' <tool_call> JSON), for tool_choice required or named.
TOOL_CALL_KEYS = {"format", "tools", "tool_choice", "parallel_tool_calls", "reasoning"}
# Bounds on what a request may ask to compile: a constraint's canonical text, and a choice list.
# xgrammar's compile time grows with the grammar; these keep one request's compile in the
# hundreds of milliseconds on a 150k vocabulary (bench/structured_output.py), the compile
# timeout (engine.grammar.compiler) bounds the rest.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1024
FIELD = "structured_output"


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: its ``kind`` (one of :data:`KINDS`) and its ``text``: the schema as compact
    JSON (keys in the request's order: a schema's property order is the output's), the regex, the
    choices as a JSON list, the EBNF grammar; empty for ``json_object``. ``(kind, text)`` is the
    compile cache's key."""

    kind: str
    text: str

    @classmethod
    def from_request(cls, value: Any) -> GrammarSpec:
        """From the native ``structured_output`` object; typed 422s name what is wrong."""
        if isinstance(value, GrammarSpec):
            return value
        if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in KINDS:
            raise _invalid(f"must be an object with exactly one of {', '.join(KINDS)}")
        kind, given = next(iter(value.items()))
        spec = cls(kind, _text(kind, given))
        if len(spec.text) > MAX_GRAMMAR_CHARS:
            raise GrammarTooComplexError(
                f"the {kind} constraint is {len(spec.text)} characters; at most {MAX_GRAMMAR_CHARS} are compiled",
                errors={FIELD: [f"at most {MAX_GRAMMAR_CHARS} characters"]})
        return spec

    def to_request(self) -> dict[str, Any]:
        """The native object this spec reads back from (what a job record stores)."""
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind in ("json_schema", "choice", "tool_calls"):
            return {self.kind: json.loads(self.text)}
        return {self.kind: self.text}


def _text(kind: str, given: Any) -> str:
    if kind == "json_schema":
        if not isinstance(given, dict):
            raise _invalid("json_schema must be a JSON Schema object")
        return json.dumps(given, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    if kind == "json_object":
        if given is not True:
            raise _invalid("json_object must be true")
        return ""
    if kind == "tool_calls":
        if (not isinstance(given, dict) or set(given) != TOOL_CALL_KEYS or not isinstance(given["format"], str)
                or not isinstance(given["tools"], list) or not given["tools"]):
            raise _invalid(f"tool_calls must be an object of {', '.join(sorted(TOOL_CALL_KEYS))} with tools")
        return json.dumps(given, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    if kind == "choice":
        if (not isinstance(given, list) or not 0 < len(given) <= MAX_CHOICES
                or not all(isinstance(item, str) and item for item in given)):
            raise _invalid(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
        return json.dumps(given, separators=(",", ":"), ensure_ascii=False)
    if not isinstance(given, str) or not given:
        raise _invalid(f"{kind} must be a non-empty string")
    return given


def _invalid(message: str) -> InvalidGrammarError:
    return InvalidGrammarError(f"invalid {FIELD}: {message}", errors={FIELD: [message]})
