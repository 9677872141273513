"""Sampling masks and logprobs_mode in the native API (#51 item 4): stored as given, reaching the
engine's SamplingParams, refused by name when bad, returned in the result's choices, and the size
guard (web/api/sampling_mask.py). No workers here: tests/e2e/test_sampling_mask_e2e.py runs them."""

from __future__ import annotations

import pytest

from domain.jobs.request import sampling_params
from tests.web.conftest import auth
from web.api.sampling_mask import MAX_SAMPLING_MASK_IDS, SamplingMaskUnboundedError, check_sampling_mask
from web.api.schemas import JobSchema

QWEN_VOCAB = 151_936


def _submit(client, params):
    return client.post("/v1/jobs", json={"token_ids": [1, 2, 3], "sampling_params": params}, headers=auth())


def test_the_knobs_are_stored_and_reach_the_engines_params(client):
    reply = _submit(client, {"sampling_mask": True, "logprobs_mode": "processed", "top_k": 5, "seed": 3})
    assert reply.status_code == 202, reply.get_json()
    stored = client.application.extensions["rollout"].jobs.get(reply.get_json()["id"])["request"]["sampling_params"]
    params = sampling_params(stored)
    assert params.sampling_mask is True and params.logprobs_mode == "processed" and params.top_k == 5


def test_the_defaults_are_raw_and_no_mask(client):
    stored = client.application.extensions["rollout"].jobs.get(_submit(client, {}).get_json()["id"])["request"]
    params = sampling_params(stored["sampling_params"])
    assert params.sampling_mask is False and params.logprobs_mode == "raw"


@pytest.mark.parametrize("params, field", [
    ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode"),  # vLLM's spelling: its routes take it
    ({"logprobs_mode": None}, "logprobs_mode"),
    ({"sampling_mask": "yes"}, "sampling_mask"),
    ({"sampling_mask": 1}, "sampling_mask"),
])
def test_bad_values_are_a_422_naming_the_field(client, params, field):
    reply = _submit(client, params)
    assert reply.status_code == 422, reply.get_json()
    body = reply.get_json()
    assert body["code"] == "invalid_request" and field in str(body["errors"]), body


def test_a_result_carries_each_choices_mask():
    mask = {"token_ids": [7, 9, 7, 8, 11], "offsets": [0, 2, 5]}
    job = {"id": "job_1", "status": "succeeded", "result": {"choices": [
        {"index": 0, "token_ids": [7, 8], "logprobs": [-0.1, -0.2], "finish_reason": "length", "sampling_mask": mask}]}}
    assert JobSchema().dump(job)["result"]["choices"][0]["sampling_mask"] == mask


@pytest.mark.parametrize("params", [
    {"top_k": 5}, {"top_k": MAX_SAMPLING_MASK_IDS}, {"top_p": 0.9}, {"min_p": 0.05}, {"temperature": 0.0},
    {"top_k": -1, "sampling_mask": False},
])
def test_a_bounded_mask_is_served(params):
    check_sampling_mask({"sampling_mask": True, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0,
                         **params}, QWEN_VOCAB)


@pytest.mark.parametrize("params", [{"top_k": -1}, {"top_k": MAX_SAMPLING_MASK_IDS + 1}])
def test_an_unbounded_mask_on_a_large_vocabulary_is_refused(params):
    with pytest.raises(SamplingMaskUnboundedError) as caught:
        check_sampling_mask({"sampling_mask": True, "temperature": 1.0, "top_p": 1.0, "min_p": 0.0, **params},
                            QWEN_VOCAB)
    assert caught.value.code == "sampling_mask_unbounded" and caught.value.errors["vocab_size"] == QWEN_VOCAB


def test_a_small_vocabulary_bounds_the_mask_itself(client):
    # The demo model's few hundred ids: a whole-vocabulary mask is small, so it is served.
    reply = _submit(client, {"sampling_mask": True})
    assert reply.status_code == 202, reply.get_json()
