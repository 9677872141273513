"""Structured outputs in each dialect (#57 item 2): OpenAI's response_format, vLLM's
structured_outputs / guided_*, SGLang's json_schema / regex / ebnf and the native
sampling_params.structured_output all land as the one native constraint on the stored job; bad
ones are a 422 invalid_grammar (or grammar_too_complex) before any job. No workers here (a sync
call times out at once, its job kept); tests/e2e/test_structured_output_e2e.py runs the engine."""

from __future__ import annotations

import json

import pytest

from engine.grammar.spec import MAX_GRAMMAR_CHARS
from tests.web.conftest import auth

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": [10, 11], "max_tokens": 2}


@pytest.fixture
def client(make_app):
    return make_app(sync_timeout_max=0.2).test_client()


def _stored(client) -> dict | None:
    (job,) = client.get("/v1/jobs", headers=auth()).get_json()["data"]
    return client.application.extensions["rollout"].jobs.get(job["id"])["request"]["sampling_params"].get(
        "structured_output")


CASES = [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, {"json_object": True}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA, "strict": True}}}, {"json_schema": SCHEMA}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}, None),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA}}}, {"json_schema": SCHEMA}),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": json.dumps(SCHEMA),
                                                              "disable_any_whitespace": True}},
     {"json_schema": SCHEMA}),
    ("/v1/chat/completions", {**CHAT, "guided_json": SCHEMA}, {"json_schema": SCHEMA}),
    ("/v1/completions", {**COMPLETION, "guided_choice": ["x", "y"]}, {"choice": ["x", "y"]}),
    ("/v1/completions", {**COMPLETION, "guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    ("/inference/v1/generate", {"token_ids": [10, 11], "sampling_params": {
        "max_tokens": 2, "structured_outputs": {"json_object": True}}}, {"json_object": True}),
    ("/inference/v1/generate", {"token_ids": [10, 11], "sampling_params": {
        "max_tokens": 2, "guided_decoding": {"regex": "a+"}}}, {"regex": "a+"}),
    ("/generate", {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 2, "json_schema": json.dumps(SCHEMA)}},
     {"json_schema": SCHEMA}),
    ("/generate", {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 2, "json_schema": "$$ANY$$"}},
     {"json_object": True}),
    ("/generate", {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 2, "regex": "(yes|no)"}},
     {"regex": "(yes|no)"}),
    ("/generate", {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 2, "ebnf": 'root ::= "a"'}},
     {"grammar": 'root ::= "a"'}),
    ("/v1/jobs?wait=0", {"token_ids": [10, 11], "sampling_params": {"max_tokens": 2, "structured_output": {
        "choice": ["a", "b"]}}}, {"choice": ["a", "b"]}),
]


@pytest.mark.parametrize(("path", "body", "native"), CASES)
def test_each_dialect_field_lands_as_the_native_constraint(client, path, body, native):
    status = client.post(path, json=body, headers=auth()).status_code
    assert status in (200, 201, 202, 504), status
    assert _stored(client) == native


@pytest.mark.parametrize(("path", "body", "field", "code"), [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema", "invalid_grammar"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "structural_tag"}}, "response_format.type",
     "invalid_grammar"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
     "structured_outputs", "invalid_grammar"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "invalid_grammar"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "invalid_grammar"),
    ("/v1/completions", {**COMPLETION, "guided_json": "{not json"}, "guided_json", "invalid_grammar"),
    ("/v1/completions", {**COMPLETION, "guided_choice": []}, "structured_output", "invalid_grammar"),
    ("/generate", {"input_ids": [10], "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "regex",
     "invalid_grammar"),
    ("/v1/jobs", {"token_ids": [10], "sampling_params": {"structured_output": {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}}},
     "structured_output", "grammar_too_complex"),
    ("/v1/jobs", {"token_ids": [10], "sampling_params": {"structured_output": {"json_schema": [1]}}},
     "structured_output", "invalid_grammar"),
])
def test_a_bad_constraint_is_a_422_naming_its_field(client, path, body, field, code):
    response = client.post(path, json=body, headers=auth())
    assert response.status_code == 422, response.get_json()
    text = json.dumps(response.get_json())
    assert code in text and field in text
    assert client.get("/v1/jobs", headers=auth()).get_json()["data"] == []
