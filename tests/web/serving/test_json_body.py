"""Parsing a request's JSON (web/serving/json_body.py): the depth limit read from the text's brackets
outside strings, checked against the parsed value's own depth."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from web.serving.json_body import MAX_JSON_DEPTH, InvalidJsonError, _depth, parse_json

TRICKY_TEXT = st.text(alphabet='[]{}"\\ab\u00e9\u2028,:', max_size=6)
VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                                TRICKY_TEXT),
                      lambda inner: st.one_of(st.lists(inner, max_size=4),
                                              st.dictionaries(TRICKY_TEXT, inner, max_size=4)), max_leaves=40)


def nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(value=VALUES, ascii_only=st.booleans())
def test_the_depth_read_from_the_text_is_the_values_own(value, ascii_only):
    assert _depth(json.dumps(value, ensure_ascii=ascii_only)) == nesting(value)


def nested(depth: int, leaf: str = '"x"') -> str:
    return "[" * depth + leaf + "]" * depth


@pytest.mark.parametrize("text", [
    nested(MAX_JSON_DEPTH),
    json.dumps({"prompt": "[" * 500}),  # brackets inside a string nest nothing
    json.dumps([[i] for i in range(500)]),  # many lists side by side, two deep
    json.dumps({"a\\\"[[": ["\\", "]]]]]"], "b": '"{{{'}),
])
def test_shallow_json_is_taken(text):
    assert parse_json(text) == json.loads(text)


@pytest.mark.parametrize("text", [
    nested(MAX_JSON_DEPTH + 1),
    nested(MAX_JSON_DEPTH + 1, leaf='"]]]]]]]]]]"'),  # a string's closing brackets do not close a list
    "[" + '"\\"]]]", ' * 3 + nested(MAX_JSON_DEPTH) + "]",
])
def test_json_past_the_depth_is_refused(text):
    with pytest.raises(InvalidJsonError):
        parse_json(text)
