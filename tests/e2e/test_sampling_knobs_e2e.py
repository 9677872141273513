"""Sampling knobs through the whole stack: the service returns what the engine computes in-process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams

KNOBS = {"max_tokens": 16, "temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.2,
         "presence_penalty": -0.4, "min_tokens": 2, "top_logprobs": 3, "prompt_logprobs": 2}


@pytest.fixture(scope="module")
def in_process(demo_model_dir):
    return Engine(load_model(str(demo_model_dir), device="cpu"))


def test_knobs_and_their_outputs_flow_through_the_service(stack, in_process):
    tokenizer = in_process.loaded.tokenizer
    prompt = tokenizer("Code: def f(x):", add_special_tokens=False)["input_ids"]
    unstopped = in_process.generate([GenerationRequest(prompt, SamplingParams(**KNOBS))])[0].choices[0]
    plain = in_process.generate([GenerationRequest(prompt, SamplingParams(max_tokens=16, temperature=0))])[0]
    assert plain.choices[0].token_ids != unstopped.token_ids  # the penalties matter here
    # A stop string from the first half of the penalized text, after the min_tokens (a stop
    # string is looked for only in text that tokens past min_tokens add).
    after_min = len(tokenizer.decode(unstopped.token_ids[:KNOBS["min_tokens"]]))
    stop = next(unstopped.text[i:i + 2] for i in range(after_min, len(unstopped.text) // 2)
                if "\ufffd" not in unstopped.text[i:i + 2] and unstopped.text[i:i + 2].strip())
    params = SamplingParams(**KNOBS, stop=(stop,))
    expected = in_process.generate([GenerationRequest(prompt, params)])[0]

    body = {"token_ids": prompt, "sampling_params": {**KNOBS, "stop": stop}}
    done = stack.wait(stack.submit(body)["id"])
    assert done["status"] == "succeeded", done
    result, want = done["result"], expected.choices[0]
    choice = result["choices"][0]
    assert choice["token_ids"] == want.token_ids and len(want.token_ids) < len(unstopped.token_ids)
    assert (choice["finish_reason"], choice["matched_stop"], choice["text"]) == ("stop", stop, want.text)
    assert choice["text"] == unstopped.text[: unstopped.text.index(stop)]
    assert [[t for t, _ in step] for step in choice["top_logprobs"]] == [[t for t, _ in s] for s in want.top_logprobs]
    torch.testing.assert_close(choice["logprobs"], want.logprobs, atol=1e-5, rtol=0)
    assert result["prompt_logprobs"][0] is None and len(result["prompt_logprobs"]) == len(prompt)
    torch.testing.assert_close(result["prompt_logprobs"][1:], expected.prompt_logprobs[1:], atol=1e-5, rtol=0)
    assert [[t for t, _ in s] for s in result["prompt_top_logprobs"][1:]] == [
        [t for t, _ in s] for s in expected.prompt_top_logprobs[1:]]

    kept = stack.client.post("/v1/generate", json={**body, "sampling_params": {**body["sampling_params"],
                                                                            "include_stop_str_in_output": True}},
                             headers=stack.headers())
    assert kept.status_code == 200, kept.get_json()
    reply = kept.get_json()
    assert reply["choices"][0]["text"] == want.text + stop and reply["choices"][0]["matched_stop"] == stop
    assert len(reply["prompt_logprobs"]) == len(prompt)
    same = in_process.generate([GenerationRequest(prompt, dataclasses.replace(params, include_stop_str_in_output=True))])
    assert reply["choices"][0]["token_ids"] == same[0].choices[0].token_ids


def test_an_unknown_knob_is_refused_by_name(stack):
    response = stack.client.post("/v1/jobs", json={"token_ids": [5, 6], "sampling_params": {"logit_bias": {"1": 2}}},
                                 headers=stack.headers())
    assert response.status_code == 422 and "logit_bias" in response.get_json()["errors"]["sampling_params"]
