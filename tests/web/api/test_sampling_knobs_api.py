"""The sampling knobs in the native API: stored as given, refused by name when out of range, and
returned in the job's result shape (no workers here; tests/e2e runs them through the engine)."""

from __future__ import annotations

import pytest

from domain.jobs.request import sampling_params
from tests.web.conftest import auth
from web.api.schemas import JobSchema

KNOBS = {"max_tokens": 8, "stop": "\n\n", "include_stop_str_in_output": True, "min_tokens": 2,
         "repetition_penalty": 1.1, "frequency_penalty": -0.5, "presence_penalty": 0.25, "top_logprobs": 5,
         "prompt_logprobs": 0, "detokenize": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
         "max_policy_lag": 1}


def submit(client, params):
    return client.post("/v1/jobs", json={"token_ids": [1, 2, 3], "sampling_params": params}, headers=auth())


def test_knobs_are_stored_and_reach_the_engines_params(client):
    response = submit(client, KNOBS)
    assert response.status_code == 202, response.get_json()
    stored = client.application.extensions["rollout"].jobs.get(response.get_json()["id"])["request"]["sampling_params"]
    assert stored["stop"] == ["\n\n"]  # one string is a list of one
    params = sampling_params(stored)
    for name, value in KNOBS.items():
        assert getattr(params, name) == (("\n\n",) if name == "stop" else value), name


def test_defaults_are_the_engines_defaults(client):
    from engine.sampling_params import SamplingParams

    stored = client.application.extensions["rollout"].jobs.get(submit(client, {}).get_json()["id"])["request"]
    params, default = sampling_params(stored["sampling_params"]), SamplingParams()
    for name in ("stop", "include_stop_str_in_output", "min_tokens", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "top_logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens",
                 "spaces_between_special_tokens", "max_policy_lag"):
        assert getattr(params, name) == getattr(default, name), name


def test_a_job_stored_before_the_knobs_existed_still_runs_with_defaults():
    old = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": None, "n": 1,
           "stop_token_ids": [], "ignore_eos": False, "logprobs": True}
    params = sampling_params(old)
    assert params.stop == () and params.repetition_penalty == 1.0 and params.prompt_logprobs is None


@pytest.mark.parametrize("params, field", [
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"min_tokens": 100_000}, "min_tokens"),  # above the default max_tokens, filled in on submit
    ({"stop": [""]}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop": ["x"], "detokenize": False}, "stop"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 1.5}, "top_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_policy_lag": -1}, "max_policy_lag"),
    ({"max_policy_lag": 0.5}, "max_policy_lag"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),  # a knob we do not implement: named, never dropped
    ({"no_stop_trim": True}, "no_stop_trim"),  # dialect names belong to their adapters
])
def test_bad_or_unknown_knobs_are_a_422_naming_them(client, params, field):
    response = submit(client, params)
    assert response.status_code == 422, response.get_json()
    assert field in str(response.get_json()["errors"])


def test_the_result_schema_returns_the_new_outputs():
    choice = {"index": 0, "token_ids": [5, 6], "logprobs": [-0.5, -1.0], "finish_reason": "stop",
              "matched_stop": "\n\n", "text": "hi", "top_logprobs": [[[5, -0.5], [7, -1.5]], [[6, -1.0], [5, -2.0]]],
              "weight_versions": [{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 2}],
              "kv_recomputed": False}
    job = {"id": "job_x", "kind": "generate", "status": "succeeded",
           "result": {"choices": [choice, {**choice, "matched_stop": 6, "text": None, "top_logprobs": None}],
                      "prompt_logprobs": [None, -2.5], "prompt_top_logprobs": [None, [[9, -0.1]]],
                      "prompt_logprobs_version": "v2"}}
    dumped = JobSchema().dump(job)["result"]
    assert dumped["choices"][0] == choice
    assert dumped["choices"][1]["matched_stop"] == 6 and dumped["choices"][1]["text"] is None
    assert dumped["prompt_logprobs"] == [None, -2.5] and dumped["prompt_top_logprobs"] == [None, [[9, -0.1]]]
    assert dumped["prompt_logprobs_version"] == "v2"
