"""Knobs the dialect routes accepted and ignored (#26) are honoured or refused by name: a 422 in the
dialect's shape naming the field, before any job exists."""

from __future__ import annotations

import pytest

from tests.web.conftest import auth


@pytest.fixture
def model(client):
    return client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]


def _refused(client, path, body, field):
    reply = client.post(path, json=body, headers=auth())
    assert reply.status_code == 422, (body, reply.get_json())
    error = reply.get_json().get("error") or reply.get_json()
    assert field in str(error), error
    jobs = client.get("/v1/jobs", headers=auth()).get_json()["data"]
    assert jobs == []


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("extra", "field"), [
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: OpenAI refuses it too
    ({"stream": True, "stream_options": {"include_usage": True, "junk": 1}}, "junk"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats"),
])
def test_chat_knobs(client, model, extra, field):
    _refused(client, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 1, **extra}, field)


@pytest.mark.parametrize("name, value", [("audio", {"id": "audio_1"}), ("refusal", "I cannot")])
def test_message_fields_that_are_not_served(client, model, name, value):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", name: value},
                {"role": "user", "content": "again"}]
    _refused(client, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1},
             f"messages[1].{name}")


def test_vllm_features_kwargs_data_must_stay_null(client):
    body = {"token_ids": [100, 101], "sampling_params": {"max_tokens": 1},
            "features": {"content_parts": [], "kwargs_data": {"pixel_values": [1, 2]}}}
    _refused(client, "/inference/v1/generate", body, "kwargs_data")


@pytest.mark.parametrize("modalities", [["video"], [True, [{"x": 1}]], [["image"]], "image"])
def test_sglang_modalities_other_than_image_are_refused(client, modalities):
    # A list inside the list was a 500 (unhashable in a set): found by the schema fuzzer.
    _refused(client, "/generate", {"text": "hi", "modalities": modalities, "sampling_params": {"max_new_tokens": 1}},
             "modalities")
