"""Tool-call parsers on fixed texts: each family's markup as its models write it (vLLM's hermes and
mistral parsers' test cases in spirit: one call, several, text around them, arguments of every
JSON kind, a cut-off call, markup that names no function)."""

from __future__ import annotations

import json

import pytest

from web.parsers.tool import TOOL_PARSERS

HERMES = TOOL_PARSERS["hermes"]()
MISTRAL = TOOL_PARSERS["mistral"]()


def calls(parse):
    return [(call.name, json.loads(call.arguments)) for call in parse.calls]


def test_hermes_one_call_as_qwen3_writes_it():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    parsed = HERMES.parse(text)
    assert calls(parsed) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert parsed.calls[0].arguments == '{"city": "Paris", "unit": "c"}'  # the model's own text
    assert parsed.content == ""


def test_hermes_parallel_calls_with_text_before_between_and_after():
    text = ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}\n</tool_call>\n'
            'and\n<tool_call>{"arguments": {"q": "</tool"}, "name": "b"}</tool_call>\nDone.')
    parsed = HERMES.parse(text)
    assert calls(parsed) == [("a", {"x": [1, {"y": "}"}]}), ("b", {"q": "</tool"})]
    assert parsed.content == "Let me check.\n\nand\n\nDone."


def test_hermes_arguments_of_every_json_kind_and_escapes():
    args = {"s": 'quote " and \\ back', "n": -1.5e3, "t": True, "f": False, "z": None, "u": "猫", "l": []}
    text = f'<tool_call>{{"name": "k", "arguments": {json.dumps(args, ensure_ascii=False)}}}</tool_call>'
    assert calls(HERMES.parse(text)) == [("k", args)]


def test_hermes_call_without_arguments_gets_an_empty_object_and_parameters_is_read():
    assert HERMES.parse('<tool_call>{"name": "now"}</tool_call>').calls[0].arguments == "{}"
    assert calls(HERMES.parse('<tool_call>{"name": "p", "parameters": {"a": 1}}</tool_call>')) == [("p", {"a": 1})]


def test_hermes_a_cut_off_call_keeps_what_was_written():
    parsed = HERMES.parse('Hi<tool_call>\n{"name": "f", "arguments": {"a": "par')
    assert [(c.name, c.arguments, c.complete) for c in parsed.calls] == [("f", '{"a": "par', True)]
    assert parsed.content == "Hi"


def test_hermes_markup_that_names_no_function_stays_content():
    text = "I would use <tool_call>not json</tool_call> here."
    parsed = HERMES.parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_hermes_plain_text_is_all_content_and_a_stream_holds_back_a_marker_start():
    assert HERMES.parse("Hello there  ").content == "Hello there  "
    assert HERMES.parse("Hello <tool_", final=False).content == "Hello"
    assert HERMES.parse("Hello <tool_x", final=False).content == "Hello <tool_x"


def test_mistral_array_of_calls():
    text = 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    parsed = MISTRAL.parse(text)
    assert calls(parsed) == [("a", {"x": 1}), ("b", {})]
    assert parsed.content == "Sure."


def test_mistral_marker_not_followed_by_an_array_is_content():
    parsed = MISTRAL.parse("[TOOL_CALLS] oops")
    assert parsed.calls == [] and parsed.content == "[TOOL_CALLS] oops"


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_every_parser_leaves_text_without_its_marker_alone(name):
    text = 'A {"name": "x", "arguments": {}} that is just text.'
    parsed = TOOL_PARSERS[name]().parse(text)
    assert parsed.calls == [] and parsed.content == text
