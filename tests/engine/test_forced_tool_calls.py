"""tool_choice required or named, engine side (#57 item 2): a ``tool_calls`` constraint on the
demo-qwen3 model samples calls in its own Hermes format whose arguments are valid against the
tool's schema, for every seed, within a few hundred tokens (the web side:
tests/web/dialects/test_forced_tool_calls.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.generation import Engine, GenerationRequest
from engine.sampling_params import SamplingParams

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"], "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, ADD)}
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from engine.demo_model import build_demo_model
    from engine.loading import load_model

    directory = build_demo_model(tmp_path_factory.mktemp("models") / "demo-qwen3", arch="qwen3_tools")
    return Engine(load_model(str(directory), device="cpu"))


def calls(qwen3, tool_choice, seeds=range(12)) -> list:
    tok = qwen3.loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, ADD],
                                     add_generation_prompt=True, enable_thinking=False, tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    constraint = {"tool_calls": {"format": "qwen_3", "tools": [WEATHER, ADD], "tool_choice": tool_choice,
                                 "parallel_tool_calls": False, "reasoning": "disabled"}}
    results = qwen3.generate([GenerationRequest(ids, SamplingParams(max_tokens=300, seed=seed,
                                                                    structured_output=constraint))
                              for seed in seeds])
    return [result.choices[0] for result in results]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_every_seed_calls_a_tool_with_arguments_valid_against_its_schema(qwen3, tool_choice):
    names = set()
    for choice in calls(qwen3, tool_choice):
        assert choice.finish_reason == "stop" and len(choice.token_ids) < 200, choice.text
        [body] = CALL.findall(choice.text)
        assert choice.text == f"<tool_call>\n{body}\n</tool_call>"
        call = json.loads(body)
        assert set(call) == {"name", "arguments"}
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
        names.add(call["name"])
    assert names == ({"add"} if isinstance(tool_choice, dict) else {"add", "get_weather"})
