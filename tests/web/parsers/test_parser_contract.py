"""The contract every registered parser keeps, enumerated from the registries (a parser added
later is covered without editing this file, once it has a writer here):

- a text with N calls written in the parser's markup parses back to those N calls, names and
  arguments equal, with content around them;
- the same text streamed in any chunking gives deltas that add up to the whole text's message
  (content, reasoning, each call's name and arguments), and the official ``openai`` client's own
  stream assembly (``ChatCompletionStreamState``) makes the same message of them.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from web.parsers.message import MessageParsers, MessageStream, parsed_message
from web.parsers.reasoning import REASONING_PARSERS
from web.parsers.tool import TOOL_PARSERS


def _hermes(calls) -> str:  # Qwen3's chat template's form
    return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a, ensure_ascii=False)}}}\n</tool_call>'
                     for n, a in calls)


def _mistral(calls) -> str:
    return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


WRITERS = {"hermes": _hermes, "mistral": _mistral}

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=12)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3), max_leaves=8)
arguments = st.dictionaries(st.text(max_size=8), values, max_size=4)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=4)
# Text around calls: anything that holds no whole marker (markers' first characters are welcome).
_MARKERS = [cls.start for cls in TOOL_PARSERS.values()] + ["think>"]
plain = (st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
         | st.sampled_from(["<", "<tool_", "[TOOL", "</thi", " \n ", "<think"])).filter(
    lambda t: not any(marker in t for marker in _MARKERS))
_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_every_tool_parser_has_a_writer_here():
    assert set(WRITERS) == set(TOOL_PARSERS)


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)] or [""]


def _streamed(text: str, parsers: MessageParsers, cuts: list[int]) -> tuple[dict, list[dict]]:
    stream, deltas = MessageStream(parsers), []
    pieces = _chunks(text, cuts)
    for i, piece in enumerate(pieces):
        deltas.append(stream.feed(piece, final=i == len(pieces) - 1))
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    by_index: dict[int, dict] = {}
    for d in deltas:
        for entry in d.get("tool_calls", []):
            call = by_index.setdefault(entry["index"], {"name": None, "arguments": "", "id": None})
            if "id" in entry:
                assert call["id"] is None, "id and name come once, first"
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            call["arguments"] += entry["function"]["arguments"]
    assert sorted(by_index) == list(range(len(by_index)))
    message = {"content": content or None if by_index or reasoning else content, "reasoning_content": reasoning or None,
               "tool_calls": [by_index[i] for i in sorted(by_index)]}
    return message, deltas


def _openai_assembled(deltas: list[dict]) -> dict:
    state = ChatCompletionStreamState()
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    state.handle_chunk(ChatCompletionChunk.model_validate(
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
    for delta in deltas:
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
    state.handle_chunk(ChatCompletionChunk.model_validate(
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    message = state.get_final_completion().choices[0].message
    return {"content": message.content,
            "tool_calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []]}


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"] if "function" in c else c["name"],
             c["function"]["arguments"] if "function" in c else c["arguments"]) for c in message["tool_calls"]]


@_SETTINGS
@given(data=st.data(), written=calls, before=plain, after=plain)
def test_n_calls_round_trip_and_any_chunking_streams_the_same_message(data, written, before, after):
    for name, parser_cls in sorted(TOOL_PARSERS.items()):
        text = before + WRITERS[name](written) + after
        parsers = MessageParsers(tools=parser_cls())
        whole = parsed_message(text, parsers)
        assert [(n, json.loads(a)) for n, a in _calls(whole)] == [(n, a) for n, a in written], (name, text)
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label=f"{name} cuts")
        streamed, deltas = _streamed(text, parsers, cuts)
        assert _calls(streamed) == _calls(whole), (name, text, cuts)
        assert streamed["content"] == whole["content"], (name, text, cuts)
        assembled = _openai_assembled(deltas)
        assert assembled["tool_calls"] == _calls(whole) and (assembled["content"] or None) == whole["content"]


@_SETTINGS
@given(data=st.data(), thought=plain, answer=plain, written=st.none() | calls, opened=st.booleans())
def test_reasoning_then_calls_stream_as_the_whole_text_parses(data, thought, answer, written, opened):
    for reasoning_name, reasoning_cls in sorted(REASONING_PARSERS.items()):
        text = ("<think>" if opened else "") + thought + "</think>\n\n" + answer + (_hermes(written) if written else "")
        parsers = MessageParsers(reasoning_cls(), TOOL_PARSERS["hermes"]())
        whole = parsed_message(text, parsers)
        assert whole["reasoning_content"] == (thought or None)
        assert len(whole["tool_calls"]) == len(written or [])
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label=f"{reasoning_name} cuts")
        streamed, _ = _streamed(text, parsers, cuts)
        assert streamed["reasoning_content"] == whole["reasoning_content"], (text, cuts)
        assert streamed["content"] == whole["content"] and _calls(streamed) == _calls(whole), (text, cuts)


def test_the_settings_offer_every_registered_parser_and_auto_picks_each_by_its_markup():
    import dataclasses
    from types import SimpleNamespace

    from domain.settings import Settings
    from web.parsers import select

    choices = {f.name: f.metadata["one_of"] for f in dataclasses.fields(Settings) if "one_of" in f.metadata}
    assert set(choices["tool_call_parser"]) == {"auto", "none", *TOOL_PARSERS}
    assert set(choices["reasoning_parser"]) == {"auto", "none", *REASONING_PARSERS}
    for name, cls in TOOL_PARSERS.items():
        tok = SimpleNamespace(chat_template=f"{{{{ messages }}}} {cls.start}")
        assert select.tool_parser_name(tok, "auto") == name and select.tool_parser_name(tok, "none") is None
    thinking = SimpleNamespace(chat_template="{% if enable_thinking %}</think>{% endif %}")
    assert select.reasoning_parser(thinking, "auto", {}).name == "qwen3"
    assert select.reasoning_parser(thinking, "auto", {"enable_thinking": False}) is None
    assert select.reasoning_parser(SimpleNamespace(chat_template="</think>"), "auto", {}).name == "deepseek_r1"
    assert select.reasoning_parser(SimpleNamespace(chat_template="plain"), "auto", {}) is None
