"""Where a tool call's JSON object puts its ``name`` and its arguments, in a text that may still
be growing.

Hand-written rather than taken from ``partial-json-parser`` (vLLM's choice): that library returns a
partial *value*, and re-serializing a partial value gives text that is not a prefix of the final
one (it closes open strings and objects). A stream's argument fragments must add up to the model's
own text, so this scanner returns *offsets* into the text: the arguments are streamed as the
model wrote them, and the whole-text parse returns the same characters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters"; vLLM reads both


@dataclass(frozen=True)
class ObjectScan:
    """One ``{...}`` as far as the text goes: ``name`` once its string is whole, the arguments'
    span (``args_end`` None while the value is open), ``end`` past the closing brace once closed."""

    name: str | None
    args_start: int | None
    args_end: int | None
    end: int | None

    def arguments(self, text: str) -> str:
        """The arguments' text so far: the value as written, whitespace after an open scalar left
        out (it may end the value), ``{}`` for a closed object that has none."""
        if self.args_start is None:
            return "{}" if self.end is not None else ""
        return text[self.args_start:self.args_end].rstrip() if self.args_end is not None else \
            text[self.args_start:].rstrip() if text[self.args_start] not in "{[\"" else text[self.args_start:]


def scan_object(text: str, start: int) -> ObjectScan:
    """Scan the object opening at ``text[start] == "{"``: its top-level keys, their values' spans."""
    depth, in_string, escaped = 0, False, False
    expect, key, role = "key", None, ""
    string_start = value_start = -1
    name = args_start = args_end = None

    def value_done(end: int) -> None:
        nonlocal name, args_start, args_end, expect, value_start
        raw = text[value_start:end]
        if key == "name" and raw.startswith('"'):
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
        elif key in ARGUMENT_KEYS and args_start is None:
            args_start, args_end = value_start, value_start + len(raw.rstrip())
        expect, value_start = "comma", -1

    for at in range(start, len(text)):
        c = text[at]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if role == "key":
                    try:
                        key = json.loads(text[string_start:at + 1])
                    except ValueError:
                        key = None
                    expect = "colon"
                elif role == "value":
                    value_done(at + 1)
            continue
        if c == '"':
            in_string, string_start = True, at
            role = "key" if depth == 1 and expect == "key" else "value" if depth == 1 and expect == "value" else ""
            if role == "value":
                value_start, expect = at, "string"
        elif c in "{[":
            if depth == 1 and expect == "value":
                value_start, expect = at, "nested"
            depth += 1
        elif c in "}]":
            if depth == 1 and expect == "scalar":
                value_done(at)
            depth -= 1
            if depth == 0:
                return ObjectScan(name, args_start, args_end, at + 1)
            if depth == 1 and expect == "nested":
                value_done(at + 1)
        elif depth == 1:
            if c == ":" and expect == "colon":
                expect = "value"
            elif c == ",":
                if expect == "scalar":
                    value_done(at)
                expect = "key"
            elif expect == "value" and not c.isspace():
                value_start, expect = at, "scalar"
    if key in ARGUMENT_KEYS and args_start is None and expect in ("string", "nested", "scalar"):
        args_start = value_start  # the arguments' value is open where the text ends
    return ObjectScan(name, args_start, args_end, None)


def scan_array(text: str, start: int) -> tuple[list[ObjectScan], int | None]:
    """The objects of the array opening at ``text[start] == "["``, and the index past its ``]``
    (None while open). Anything but objects, commas and whitespace ends it where it stands."""
    objects: list[ObjectScan] = []
    at = start + 1
    while at < len(text):
        c = text[at]
        if c.isspace() or c == ",":
            at += 1
        elif c == "{":
            scanned = scan_object(text, at)
            objects.append(scanned)
            if scanned.end is None:
                return objects, None
            at = scanned.end
        elif c == "]":
            return objects, at + 1
        else:
            return objects, at
    return objects, None
