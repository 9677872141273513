"""Every token id a user sends is checked against the model's vocabulary before a job is queued:
a 422 ``token_id_out_of_range`` naming the field and the index, on every route that takes ids. No
worker runs here: a job the API let through would just stay queued."""

from __future__ import annotations

import json

import pytest

from tests.web.conftest import auth

VOCAB = 640  # the demo model's


def error_of(response) -> dict:
    assert response.status_code == 422, response.get_json()
    body = response.get_json()
    assert body["code"] == "token_id_out_of_range", body
    return body


@pytest.mark.parametrize(("body", "field", "index"), [
    ({"token_ids": [1, 2, VOCAB]}, "token_ids", 2),
    ({"token_ids": [10**9, 1]}, "token_ids", 0),
    ({"kind": "score", "token_ids": [1, 2], "completion_token_ids": [5, 9, 1, VOCAB + 12]}, "completion_token_ids", 3),
    ({"prompt": "hi", "sampling_params": {"stop_token_ids": [7, VOCAB]}}, "sampling_params.stop_token_ids", 1),
])
@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/generate"])
def test_ids_outside_the_vocabulary_are_422_naming_field_and_index(client, route, body, field, index):
    # timeout 0: without the check, /v1/generate would queue the job and answer 202 at once.
    error = error_of(client.post(route, json={**body, **({"timeout": 0} if route == "/v1/generate" else {})},
                                 headers=auth()))
    assert error["errors"] == {"field": field, "index": index, "vocab_size": VOCAB}
    assert f"{field}[{index}]" in error["message"]
    assert client.get("/v1/jobs", headers=auth()).get_json()["data"] == []  # nothing was queued


def test_sglang_input_ids_are_checked_too(client):
    response = client.post("/generate", json={"input_ids": [3, VOCAB], "sampling_params": {"max_new_tokens": 2}},
                           headers=auth())
    assert response.status_code == 422
    error = response.get_json()["error"]  # SGLang's error shape, naming SGLang's field
    assert error["code"] == "token_id_out_of_range" and error["message"].startswith("input_ids[1] ")
    assert error["errors"] == {"field": "input_ids", "index": 1, "vocab_size": VOCAB}
    assert client.get("/v1/jobs", headers=auth()).get_json()["data"] == []


@pytest.mark.parametrize(("route", "body", "field", "index"), [
    ("/generate", {"input_ids": [[1, 2], [3, VOCAB]], "sampling_params": {"max_new_tokens": 2}}, "input_ids[1]", 1),
    ("/v1/completions", {"prompt": [5, VOCAB], "max_tokens": 2}, "prompt", 1),
    ("/v1/completions", {"prompt": [[5], [6, 7, VOCAB]], "max_tokens": 2}, "prompt[1]", 2),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [VOCAB]}, "stop_token_ids", 0),
    ("/inference/v1/generate", {"token_ids": [VOCAB], "sampling_params": {"max_tokens": 2}}, "token_ids", 0),
])
def test_dialects_name_the_field_as_their_client_sent_it(client, route, body, field, index):
    if route == "/v1/completions":
        body = {**body, "model": client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]}
    response = client.post(route, json=body, headers=auth())
    assert response.status_code == 422, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "token_id_out_of_range" and error["message"].startswith(f"{field}[{index}] ")
    if route != "/generate":  # OpenAI's shape, which vLLM's routes share
        assert error["param"] == field and error["type"] == "invalid_request_error"


def test_the_last_id_of_the_vocabulary_is_accepted(client):
    # The demo model's last ids are its image (638) and video (639) placeholders, which a prompt
    # may hold only with its media: the last id as a stop id, the last other one in the prompt.
    body = {"kind": "score", "token_ids": [VOCAB - 3], "completion_token_ids": [VOCAB - 3],
            "sampling_params": {"stop_token_ids": [VOCAB - 1]}}
    assert client.post("/v1/jobs", json=body, headers=auth()).status_code == 202
    placeholder = {**body, "token_ids": [VOCAB - 1]}
    assert client.post("/v1/jobs", json=placeholder, headers=auth()).get_json()["code"] == "placeholder_mismatch"


def test_batch_lines_with_ids_outside_the_vocabulary_are_line_errors(client):
    lines = [{"custom_id": "ok", "kind": "score", "body": {"token_ids": [1, 2], "completion_token_ids": [3]}},
             {"custom_id": "bad", "kind": "score", "body": {"token_ids": [1, 2], "completion_token_ids": [3, VOCAB]}},
             {"custom_id": "bad-stop", "body": {"token_ids": [1], "sampling_params": {"stop_token_ids": [VOCAB]}}}]
    response = client.post("/v1/batches", data="\n".join(map(json.dumps, lines)), content_type="application/jsonl",
                           headers=auth())
    assert response.status_code == 202, response.get_json()
    errors = {entry["custom_id"]: entry for entry in response.get_json()["errors"]["data"]}
    assert sorted(errors) == ["bad", "bad-stop"]
    assert errors["bad"]["line"] == 2 and errors["bad"]["error"]["code"] == "token_id_out_of_range"
    assert errors["bad"]["error"]["errors"] == {"field": "completion_token_ids", "index": 1, "vocab_size": VOCAB}
    assert errors["bad-stop"]["error"]["errors"]["field"] == "sampling_params.stop_token_ids"


def test_openai_format_batch_lines_with_ids_outside_the_vocabulary_are_line_errors(client):
    """Each url's lines are checked by their own path (the dialect's or ours), none skipped."""
    model = client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]
    bodies = {"/v1/jobs": {"kind": "score", "token_ids": [1, 2], "completion_token_ids": [3, VOCAB]},
              "/v1/completions": {"model": model, "prompt": [5, VOCAB], "max_tokens": 2},
              "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 2, "stop_token_ids": [VOCAB]}}
    lines = [{"custom_id": url, "method": "POST", "url": url, "body": body} for url, body in bodies.items()]
    lines.append({"custom_id": "ok", "method": "POST", "url": "/v1/jobs", "body": {"token_ids": [1]}})
    response = client.post("/v1/batches", data="\n".join(map(json.dumps, lines)), content_type="application/jsonl",
                           headers=auth())
    assert response.status_code == 202, response.get_json()
    errors = {entry["custom_id"]: entry["error"] for entry in response.get_json()["errors"]["data"]}
    assert sorted(errors) == sorted(bodies)
    assert {url: error["code"] for url, error in errors.items()} == dict.fromkeys(bodies, "token_id_out_of_range")


def test_only_the_very_list_our_tokenizer_made_skips_the_per_id_check():
    from marshmallow import ValidationError

    from web.api.schemas import TOKENIZER_MADE, JobRequestSchema

    made = [1, 2.5, True]  # no tokenizer makes these: here they show whose list is trusted
    trusted = TOKENIZER_MADE.set(made)
    try:
        assert JobRequestSchema().load({"token_ids": made})["token_ids"] is made
        with pytest.raises(ValidationError):  # the same values, sent in a request
            JobRequestSchema().load({"token_ids": list(made)})
    finally:
        TOKENIZER_MADE.reset(trusted)
    empty = TOKENIZER_MADE.set([])
    try:
        with pytest.raises(ValidationError):  # the length is checked whoever made the list
            JobRequestSchema().load({"token_ids": TOKENIZER_MADE.get()})
    finally:
        TOKENIZER_MADE.reset(empty)


def test_prompt_ids_a_client_sends_to_completions_are_checked_per_id(client):
    model = client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]
    response = client.post("/v1/completions", json={"model": model, "prompt": [1, True], "max_tokens": 2},
                           headers=auth())
    assert response.status_code == 422, response.get_json()
    assert response.get_json()["error"]["param"] == "prompt.1", response.get_json()
