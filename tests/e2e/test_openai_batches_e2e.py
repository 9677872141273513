"""OpenAI's Batch API with the official ``openai`` client as the caller, over HTTP on loopback,
against the real workers (CPU, GPU, batches) and the tiny demo model: upload -> create -> poll ->
download (output and errors), a file mixing valid, invalid and wrong-endpoint lines, cancel
midway, score lines with their logprobs, another key's 404s, and the CLI's progress bar."""

from __future__ import annotations

import json
import time

import openai
import pytest
from rollout_queue_client.batch_cli import run as run_cli
from rollout_queue_client.settings import ClientSettings

from tests.e2e.conftest import API_KEY, OTHER_KEY
from tests.e2e.dialect_server import serve


@pytest.fixture(scope="module")
def server(stack):
    with serve(stack) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    (served,) = client.models.list().data
    return served.id


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def chat_line(custom_id: str, model: str, text: str, max_tokens: int = 3, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, "logprobs": True}}


def wait(client, batch_id: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)


def listed_ids(resource) -> set[str]:
    """Every id the caller lists, over all pages (the client follows ``has_more``)."""
    return {item.id for item in resource.list()}


def lines_of(client, file_id: str) -> list[dict]:
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]


def test_upload_create_poll_download_a_mixed_file(client, model, stack):
    data = jsonl([
        chat_line("chat-0", model, "Hello"),
        chat_line("chat-1", model, "The sky is"),
        chat_line("wrong-endpoint", model, "Hi", url="/v1/completions"),
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"model": model}},
        "{not json",
    ])
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(data)
    assert client.files.retrieve(uploaded.id).filename == "requests.jsonl"
    assert client.files.content(uploaded.id).content == data

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"experiment": "e2e"})
    assert batch.status == "in_progress" and batch.input_file_id == uploaded.id and batch.metadata == {
        "experiment": "e2e"}
    assert batch.request_counts.total == 5 and len(batch.errors.data) == 3
    done = wait(client, batch.id)
    assert done.status == "completed" and done.completed_at >= done.in_progress_at
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 3)

    outputs = {line["custom_id"]: line for line in lines_of(client, done.output_file_id)}
    assert set(outputs) == {"chat-0", "chat-1"}
    body = outputs["chat-0"]["response"]["body"]
    assert outputs["chat-0"]["error"] is None and body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 3 and len(body["choices"][0]["logprobs"]["content"]) == 3
    # The same request through the synchronous route gives the same tokens.
    direct = client.chat.completions.create(**{k: v for k, v in chat_line("x", model, "Hello")["body"].items()
                                               if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content

    errors = {line["custom_id"]: line for line in lines_of(client, done.error_file_id)}
    assert errors["wrong-endpoint"]["response"] is None
    assert errors["wrong-endpoint"]["error"]["code"] == "endpoint_mismatch"
    assert errors["bad"]["response"]["status_code"] == 422 and errors["bad"]["error"] is None
    assert errors[None]["error"]["code"] == "invalid_json"
    listed = client.batches.list(limit=100)
    assert done.id in [b.id for b in listed.data]


def test_cancel_midway_keeps_finished_lines(client, model):
    # Ten short lines end first; the rest are long enough that none can end before the cancel,
    # however fast the machine: the cancel must stop them.
    max_tokens = {f"c{n}": 3 if n < 10 else 2000 for n in range(200)}
    data = jsonl([chat_line(custom_id, model, "Count", max_tokens=most) for custom_id, most in max_tokens.items()])
    uploaded = client.files.create(file=("long.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 10:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    assert done.request_counts.completed >= 10 and done.request_counts.failed > 0
    outputs = lines_of(client, done.output_file_id)
    assert len(outputs) == done.request_counts.completed
    assert all(line["response"]["body"]["usage"]["completion_tokens"] <= max_tokens[line["custom_id"]]
               for line in outputs)
    errors = lines_of(client, done.error_file_id)
    assert len(outputs) + len(errors) == 200
    assert {line["error"]["code"] for line in errors if line["error"]} <= {"batch_cancelled"}


def test_score_lines_carry_prompt_logprobs(client, stack):
    rows = [{"token_ids": [100 + n, 101, 102], "completion_token_ids": [110 + n, 111]} for n in range(8)]
    data = jsonl([{"custom_id": f"s{n}", "method": "POST", "url": "/v1/jobs", "body": {"kind": "score", **row}}
                  for n, row in enumerate(rows)])
    uploaded = client.files.create(file=("score.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
    done = wait(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    scored = {line["custom_id"]: line["response"]["body"] for line in lines_of(client, done.output_file_id)}
    job = stack.wait(stack.submit({"kind": "score", **rows[2]})["id"])
    assert scored["s2"]["prompt_token_ids"] == job["result"]["prompt_token_ids"]
    assert scored["s2"]["completion_logprobs"] == pytest.approx(job["result"]["completion_logprobs"], abs=1e-4)


def test_another_key_gets_404_on_the_file_and_the_batch(client, server, model):
    uploaded = client.files.create(file=("one.jsonl", jsonl([chat_line("a", model, "Hi")])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    stranger = openai.OpenAI(base_url=f"{server}/v1", api_key=OTHER_KEY, max_retries=0, timeout=60)
    for call in (lambda: stranger.files.retrieve(uploaded.id), lambda: stranger.files.content(uploaded.id),
                 lambda: stranger.files.delete(uploaded.id), lambda: stranger.batches.retrieve(batch.id),
                 lambda: stranger.batches.cancel(batch.id),
                 lambda: stranger.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as missing:
        stranger.files.retrieve(uploaded.id)
    assert missing.value.body["code"] == "not_found"  # OpenAI's error shape: the client reads body["error"]
    # Not "the stranger lists nothing": other tests on the shared stack may have left that key's own files.
    assert uploaded.id in listed_ids(client.files) and batch.id in listed_ids(client.batches)
    assert uploaded.id not in listed_ids(stranger.files) and batch.id not in listed_ids(stranger.batches)
    done = wait(client, batch.id)
    with pytest.raises(openai.NotFoundError):
        stranger.files.content(done.output_file_id)
    assert done.output_file_id in listed_ids(client.files) and done.output_file_id not in listed_ids(stranger.files)
    assert client.files.delete(uploaded.id).deleted is True


def test_the_cli_follows_an_openai_batch(client, server, model, capsys, tmp_path):
    data = jsonl([chat_line(f"p{n}", model, "Go") for n in range(30)])
    uploaded = client.files.create(file=("cli.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    status = run_cli(["wait", batch.id, "--poll-interval", "0.1", "--output", str(tmp_path / "o.jsonl"),
                      "--errors", str(tmp_path / "e.jsonl")], ClientSettings(url=server, api_key=API_KEY))
    captured = capsys.readouterr()
    assert status == 0 and "30/30" in captured.err  # the progress bar
    assert json.loads(captured.out)["output_file_id"]  # the batch in its own (OpenAI) view
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 30
