"""Structured outputs on every registered architecture (#57 item 2): each demo model's tokenizer
compiles a constraint, a constrained generation (text and, where the model takes it, an image
prompt) obeys it, and its raw logprobs stay the model's own (transformers' forward)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams
from tests.fidelity import Reference, assert_close, demo_dir_for, demo_dirs, make_prompt, registry_cases

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}
CASES = [case for case in registry_cases() if case.values[1] in ("text", "image")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from processors.registry import load_processor

    dirs, built = demo_dirs(tmp_path_factory.mktemp("structured-models")), {}

    def make(registered):
        if registered not in built:
            directory = demo_dir_for(dirs, registered)
            processor = load_processor(directory)
            built[registered] = (Engine(load_model(str(directory), device="cpu")), processor,
                                 Reference(directory, processor.hf))
        return built[registered]

    return make


@pytest.mark.parametrize(("registered", "modality"), CASES)
def test_a_constrained_generation_obeys_and_keeps_the_models_logprobs(registered, modality, setup):
    engine, processor, reference = setup(registered)
    prompt = make_prompt(processor, modality)
    requests = [GenerationRequest(prompt.token_ids, SamplingParams(
        max_tokens=100, seed=seed, structured_output={"json_schema": SCHEMA}), items=prompt.items)
                for seed in range(3)]
    for result in engine.generate(requests):
        [choice] = result.choices
        assert choice.finish_reason == "stop", (registered, choice.text)
        jsonschema.validate(json.loads(choice.text), SCHEMA)
        want = reference.token_logprobs(prompt.token_ids, choice.token_ids, prompt.items)
        assert_close(choice.logprobs, want, f"{registered} {modality} constrained logprobs")
