"""Input that once made the API answer 500 (or store what strict JSON parsers refuse): each is a 4xx
in our error shape now, refused before anything is queued, with no traceback in the log."""

from __future__ import annotations

import json
import logging

import pytest

from domain.batches.progress import record_job_lines
from domain.lifecycle import end_job
from domain.names import PREPROCESS_QUEUE
from tests.web.conftest import auth

BIG_INT = "1" + "0" * 5000
DEEP = "[" * 1000 + "]" * 1000
PAST_OUR_DEPTH = "[" * 100 + "]" * 100  # Python parses it; our own limit refuses it
JSON_HEADERS = {**auth(), "Content-Type": "application/json"}


def fill(template: str, value: str) -> str:
    """JSON text with ``value`` (raw JSON, such as a 5,000-digit number) written where ``@`` is."""
    return template.replace("@", value)


def strict_loads(text: str):
    """What JavaScript, Go or serde accept: no NaN or Infinity."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(autouse=True)
def no_traceback_logged(caplog):
    caplog.set_level(logging.INFO)
    yield
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert not tracebacks, [record.getMessage() for record in tracebacks]


def post(client, path, text: str):
    return client.post(path, data=text, headers=JSON_HEADERS)


def assert_refused(response, status, code):
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    assert body["code"] == code and body["message"]


def queued(client) -> int:
    return client.application.extensions["rollout"].redis.llen(PREPROCESS_QUEUE)


@pytest.mark.parametrize("path, text", [
    ("/v1/jobs", fill('{"token_ids": [1], "metadata": {"n": @}}', BIG_INT)),
    ("/v1/jobs", fill('{"token_ids": [@]}', BIG_INT)),
    ("/v1/generate", fill('{"token_ids": [1], "timeout": @}', BIG_INT)),
    ("/v1/render", fill('{"messages": [{"role": "user", "content": "hi", "n": @}]}', BIG_INT)),
])
def test_integers_past_4300_digits_are_422(client, path, text):
    assert_refused(post(client, path, text), 422, "unsupported_json_value")
    assert queued(client) == 0


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/generate", "/v1/render"])
@pytest.mark.parametrize("nested", [DEEP, PAST_OUR_DEPTH], ids=["1000-levels", "100-levels"])
def test_deep_nesting_is_400_on_every_json_endpoint(client, path, nested):
    assert_refused(post(client, path, fill('{"token_ids": [1], "metadata": {"x": @}}', nested)), 400, "invalid_json")


@pytest.mark.parametrize("path, text", [
    ("/v1/jobs", '{"prompt": "a\\ud800b"}'),
    ("/v1/jobs", '{"prompt": "a\\udfffb"}'),
    ("/v1/jobs", '{"token_ids": [1], "metadata": {"\\ud800": 1}}'),
    ("/v1/generate", '{"prompt": "a\\ud800", "timeout": 0}'),
    ("/v1/render", '{"messages": [{"role": "user", "content": "look \\ud800"}]}'),
    ("/v1/render", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\uDBFF"}]}]}'),
])
def test_a_lone_surrogate_is_refused_at_input(client, path, text):
    assert_refused(post(client, path, text), 422, "unsupported_json_value")
    assert queued(client) == 0


def test_a_surrogate_pair_is_one_character_and_accepted(client):
    response = post(client, "/v1/jobs", '{"prompt": "smile \\ud83d\\ude00", "metadata": {"k": "\\uD83D\\uDE00"}}')
    assert response.status_code == 202, response.get_json()
    assert response.get_json()["metadata"] == {"k": "\U0001f600"}
    assert queued(client) == 1  # what the refusals above are counted against


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_non_finite_numbers_are_refused_everywhere(client, value):
    assert_refused(post(client, "/v1/jobs", fill('{"token_ids": [1], "metadata": {"x": @}}', value)),
                   422, "unsupported_json_value")
    assert_refused(post(client, "/v1/jobs", fill('{"token_ids": [1], "sampling_params": {"top_p": @}}', value)),
                   422, "unsupported_json_value")
    batch = client.post("/v1/batches", data=b'{"custom_id": "a", "body": {"token_ids": [1]}}\n',
                        query_string={"metadata": fill('{"x": @}', value)},
                        headers={**auth(), "Content-Type": "application/jsonl"})
    assert_refused(batch, 422, "invalid_request")
    assert "metadata" in batch.get_json()["errors"]
    assert queued(client) == 0


@pytest.mark.parametrize("params, field", [
    ({"temperature": "1"}, "temperature"),
    ({"top_p": "0.5"}, "top_p"),
    ({"min_p": True}, "min_p"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"ignore_eos": "true"}, "ignore_eos"),
])
def test_float_and_boolean_fields_are_strict(client, params, field):
    response = client.post("/v1/jobs", json={"token_ids": [1], "sampling_params": params}, headers=auth())
    assert_refused(response, 422, "invalid_request")
    assert field in response.get_json()["errors"]["sampling_params"]


def test_strict_fields_still_take_json_numbers_and_booleans(client):
    params = {"temperature": 1, "top_p": 0.5, "min_p": 0, "logprobs": False, "ignore_eos": True}
    response = client.post("/v1/jobs", json={"token_ids": [1], "sampling_params": params}, headers=auth())
    assert response.status_code == 202, response.get_json()
    stored = client.application.extensions["rollout"].jobs.get(response.get_json()["id"])["request"]
    assert stored["sampling_params"]["temperature"] == 1.0 and stored["sampling_params"]["logprobs"] is False


def test_timeout_of_generate_is_strict(client):
    response = client.post("/v1/generate", json={"token_ids": [1], "timeout": "5"}, headers=auth())
    assert_refused(response, 422, "invalid_request")
    assert "timeout" in response.get_json()["errors"]


@pytest.mark.parametrize("window", ["9" * 5000, "9" * 5000 + "h", "1" + "0" * 9])
def test_a_completion_window_of_thousands_of_digits_is_422(client, window):
    response = client.post("/v1/batches", data=b'{"custom_id": "a", "body": {"token_ids": [1]}}\n',
                           query_string={"completion_window": window},
                           headers={**auth(), "Content-Type": "application/jsonl"})
    assert_refused(response, 422, "invalid_request")
    assert "completion_window" in response.get_json()["errors"]


def test_batch_lines_with_hostile_values_are_line_errors(client):
    lines = [
        '{"custom_id": "ok", "body": {"token_ids": [1]}}',
        fill('{"custom_id": "big", "body": {"token_ids": [@]}}', BIG_INT),
        '{"custom_id": "nan", "body": {"token_ids": [1], "metadata": {"x": NaN}}}',
        '{"custom_id": "sur", "body": {"prompt": "\\ud800"}}',
        fill('{"custom_id": "deep", "body": {"token_ids": [1], "metadata": {"x": @}}}', PAST_OUR_DEPTH),
    ]
    response = client.post("/v1/batches", data="\n".join(lines).encode(),
                           headers={**auth(), "Content-Type": "application/jsonl"})
    assert response.status_code == 202, response.get_json()
    errors = {entry["line"]: entry["error"]["code"] for entry in response.get_json()["errors"]["data"]}
    assert errors == {2: "unsupported_json_value", 3: "unsupported_json_value", 4: "unsupported_json_value",
                      5: "invalid_json"}


NAN_RESULT = {"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [7], "logprobs": [float("nan")],
                                                     "finish_reason": "length"}],
              "completion_logprobs": [float("-inf")]}


def test_a_non_finite_number_made_inside_is_sent_as_null(client):
    """A model can still produce a NaN logprob: no response carries the bare word NaN."""
    svc = client.application.extensions["rollout"]
    job = client.post("/v1/jobs", json={"token_ids": [1]}, headers=auth()).get_json()
    end_job(svc, job["id"], "succeeded", result=NAN_RESULT)
    polled = client.get(f"/v1/jobs/{job['id']}", headers=auth()).get_data(as_text=True)
    result = strict_loads(polled)["result"]
    assert result["choices"][0]["logprobs"] == [None] and result["completion_logprobs"] == [None]


def test_batch_output_lines_never_carry_nan(client):
    svc = client.application.extensions["rollout"]
    batch = client.post("/v1/batches", data=b'{"custom_id": "a", "body": {"token_ids": [1]}}\n',
                        headers={**auth(), "Content-Type": "application/jsonl"}).get_json()
    job = {"id": "job_x", "line": 1, "custom_id": "a", "batch_id": batch["id"], "status": "succeeded",
           "result": NAN_RESULT}
    record_job_lines(svc, [job])
    [page] = list(svc.batches.iter_results(batch["id"], "output"))
    [entry] = [strict_loads(line) for line in page]
    assert entry["response"]["body"]["choices"][0]["logprobs"] == [None]
    listed = client.get(f"/v1/batches/{batch['id']}/output", headers=auth()).get_data(as_text=True)
    assert strict_loads(listed.strip())["custom_id"] == "a"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
@pytest.mark.parametrize("path", ["/v1/jobs", "/generate", "/v1/chat/completions", "/tokenize"])
def test_a_json_body_not_declared_json_is_a_415_not_an_empty_body(client, path, content_type):
    """It read as no body at all: 422s about missing fields the body held."""
    headers = {**auth(), **({"Content-Type": content_type} if content_type else {})}
    response = client.post(path, data=b'{"token_ids": [1, 2], "prompt": "hi"}', headers=headers)
    body = response.get_json()
    assert response.status_code == 415, body
    assert (body.get("error") or body)["code"] == "unsupported_media_type"  # in each dialect's shape
    assert queued(client) == 0
