"""Streaming over real HTTP against the whole stack: the native events of a job and each
dialect's ``stream: true``, compared with the non-streamed result of the same request."""

from __future__ import annotations

import pytest
import requests

from tests.e2e.conftest import API_KEY, OTHER_KEY
from tests.e2e.dialect_server import serve
from tests.e2e.sse import messages

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(stack):
    with serve(stack, stream_keepalive_seconds=0.2) as (url, _):
        yield url


def follow(server, job_id, headers=HEADERS, **kwargs):
    with requests.get(f"{server}/v1/jobs/{job_id}/events", headers=headers, stream=True, timeout=60,
                      **kwargs) as response:
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return list(messages(response))


def test_job_events_carry_every_token_once_then_the_result(stack, server):
    # Long enough that the reader, who comes after the POST, is seen while the job still runs:
    # the tokens so far then arrive as one entry, and every later flush after it.
    job = requests.post(f"{server}/v1/jobs", headers=HEADERS, timeout=30, json={
        "token_ids": [100, 140, 150], "sampling_params": {**GREEDY, "max_tokens": 400, "logprobs": True}}).json()
    events = follow(server, job["id"])
    kinds = [m.event for m in events]
    assert kinds[0] == "status" and kinds[-1] == "result", kinds
    assert [m.json()["status"] for m in events if m.event == "status"] == [
        "queued", "generating", "succeeded"]
    tokens = [m.json() for m in events if m.event == "tokens"]
    streamed = [t for entry in tokens for c in entry["choices"] for t in c["token_ids"]]
    logprobs = [lp for entry in tokens for c in entry["choices"] for lp in c["logprobs"]]
    text = "".join(c.get("text", "") for entry in tokens for c in entry["choices"])
    result = events[-1].json()["result"]
    [choice] = result["choices"]
    assert streamed == choice["token_ids"] and len(streamed) == 400
    assert logprobs == pytest.approx(choice["logprobs"])
    assert text == choice["text"]
    assert all(m.id for m in events[:-1])


def test_a_job_submitted_with_stream_events_writes_its_tokens_from_the_start(stack, server):
    job = requests.post(f"{server}/v1/jobs", headers=HEADERS, timeout=30, json={
        "token_ids": [104, 140, 150], "sampling_params": GREEDY, "stream_events": True}).json()
    stack.wait(job["id"])  # read only once it ended: the tokens were written anyway
    events = follow(server, job["id"])
    streamed = [t for m in events if m.event == "tokens" for c in m.json()["choices"] for t in c["token_ids"]]
    assert streamed == events[-1].json()["result"]["choices"][0]["token_ids"] and len(streamed) == 24
    assert "stream_events" not in stack.services.jobs.get(job["id"])["request"]  # not a request option


def test_a_job_nobody_read_while_it_ran_writes_no_tokens_and_its_stream_has_them_in_the_result(stack, server):
    job = stack.submit({"token_ids": [102, 140, 150], "sampling_params": GREEDY})
    tokens = stack.wait(job["id"])["result"]["choices"][0]["token_ids"]
    assert [e.type for e in stack.services.events.all(job["id"])] == ["status"] * 3
    events = follow(server, job["id"])
    assert [m.event for m in events] == ["status"] * 3 + ["result"]
    assert events[-1].json()["result"]["choices"][0]["token_ids"] == tokens and len(tokens) == 24


def test_a_reader_that_comes_mid_job_gets_the_tokens_so_far_in_one_entry_then_the_rest(stack, server):
    import time

    # Long enough to still decode when the reader comes, on a machine several times faster than this one.
    job = stack.submit({"token_ids": [103, 140, 150], "sampling_params": {**GREEDY, "max_tokens": 3500}})
    deadline = time.monotonic() + 30
    while stack.services.jobs.get(job["id"])["status"] != "generating" and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # some tokens exist, unpublished: nobody read the job yet
    events = follow(server, job["id"])
    tokens = [m.json()["choices"][0] for m in events if m.event == "tokens"]
    assert tokens[0]["offset"] == 0 and len(tokens[0]["token_ids"]) > 1
    assert [t["offset"] for t in tokens[1:]] == [sum(len(t["token_ids"]) for t in tokens[:i]) for i in range(1, len(tokens))]
    assert [t for entry in tokens for t in entry["token_ids"]] == events[-1].json()["result"]["choices"][0]["token_ids"]


def test_last_event_id_resumes_after_that_event(stack, server):
    job = stack.submit({"token_ids": [101, 140, 150], "sampling_params": {**GREEDY, "max_tokens": 400}})
    everything = follow(server, job["id"])
    assert len(everything) > 6
    middle = everything[3]
    resumed = follow(server, job["id"], headers={**HEADERS, "Last-Event-ID": middle.id})
    assert [(m.event, m.data) for m in resumed] == [(m.event, m.data) for m in everything[4:]]
    by_query = follow(server, job["id"], params={"last_event_id": middle.id})
    assert [m.data for m in by_query] == [m.data for m in resumed]


def test_another_keys_job_is_a_404_and_a_bad_event_id_a_422(stack, server):
    job = stack.submit({"token_ids": [102], "sampling_params": {"max_tokens": 2}})
    other = requests.get(f"{server}/v1/jobs/{job['id']}/events", headers={"Authorization": f"Bearer {OTHER_KEY}"},
                         timeout=10)
    assert other.status_code == 404 and other.json()["code"] == "not_found"
    # Not an id at all, and well shaped but past what Redis takes (64-bit parts): a 422, never a
    # 200 stream that ends with service_unavailable.
    for bad_id in ("x", "99999999999999999999-1", "1-99999999999999999999", "1-", "-1"):
        bad = requests.get(f"{server}/v1/jobs/{job['id']}/events", headers={**HEADERS, "Last-Event-ID": bad_id},
                           timeout=10)
        assert bad.status_code == 422, (bad_id, bad.status_code, bad.text[:200])


def test_sglang_stream_chunks_are_cumulative_and_end_as_the_plain_reply(stack, server):
    body = {"input_ids": [103, 140, 150], "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                             "ignore_eos": True}, "return_logprob": True}
    plain = requests.post(f"{server}/generate", headers=HEADERS, json=body, timeout=60).json()
    with requests.post(f"{server}/generate", headers=HEADERS, json={**body, "stream": True}, stream=True,
                       timeout=60) as response:
        assert response.status_code == 200
        chunks = [m.data for m in messages(response)]
    assert chunks[-1] == "[DONE]"
    import json

    parsed = [json.loads(c) for c in chunks[:-1]]
    ids = [p["output_ids"] for p in parsed]
    assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:], strict=False)), "cumulative"
    assert len(parsed) > 2
    last = parsed[-1]
    assert last["output_ids"] == plain["output_ids"] and last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert [e[1] for e in last["meta_info"]["output_token_logprobs"]] == plain["output_ids"]
    assert parsed[0]["meta_info"]["finish_reason"] is None


def test_vllm_generate_streams_token_id_deltas(stack, server):
    body = {"token_ids": [104, 140, 150], "sampling_params": {"max_tokens": 12, "temperature": 0,
                                                             "ignore_eos": True, "logprobs": 0}}
    plain = requests.post(f"{server}/inference/v1/generate", headers=HEADERS, json=body, timeout=60).json()
    with requests.post(f"{server}/inference/v1/generate", headers=HEADERS, json={**body, "stream": True},
                       stream=True, timeout=60) as response:
        chunks = [m.data for m in messages(response)]
    assert chunks[-1] == "[DONE]"
    import json

    parsed = [json.loads(c) for c in chunks[:-1]]
    deltas = [t for p in parsed for t in p["choices"][0]["token_ids"]]
    assert deltas == plain["choices"][0]["token_ids"]
    assert [p["choices"][0]["finish_reason"] for p in parsed][-1] == plain["choices"][0]["finish_reason"]
    assert all(p["choices"][0]["finish_reason"] is None for p in parsed[:-1])
    streamed_usage, plain_usage = dict(parsed[-1]["usage"]), dict(plain["usage"])
    # The second run of the prompt finds it whole in the KV cache the first one left.
    assert streamed_usage.pop("prompt_tokens_details") == {"cached_tokens": 3}
    plain_usage.pop("prompt_tokens_details")
    assert streamed_usage == plain_usage
    streamed_lps = [e["logprob"] for p in parsed for e in (p["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert streamed_lps == pytest.approx([e["logprob"] for e in plain["choices"][0]["logprobs"]["content"]])


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_openai_completions_stream_with_the_official_client(openai_client):
    model = openai_client.models.list().data[0].id
    args = {"model": model, "prompt": "a cat sat", "max_tokens": 16, "temperature": 0, "seed": 7,
            "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    plain = openai_client.completions.create(**args)
    chunks = list(openai_client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(chunk.usage is None for chunk in chunks[:-1])
    text = "".join(c.choices[0].text for c in chunks[:-1])
    ids = [t for c in chunks[:-1] for t in c.choices[0].model_extra["token_ids"]]
    assert text == plain.choices[0].text
    assert ids == plain.choices[0].model_extra["token_ids"]
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_openai_chat_stream_with_the_official_client(openai_client):
    model = openai_client.models.list().data[0].id
    args = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12,
            "temperature": 0.8, "seed": 11, "logprobs": True, "extra_body": {"ignore_eos": True}}
    plain = openai_client.chat.completions.create(**args)
    chunks = list(openai_client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == plain.choices[0].message.content
    streamed = [e.logprob for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in plain.choices[0].logprobs.content])
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_a_client_that_leaves_a_dialect_stream_cancels_its_job(stack, server):
    body = {"input_ids": [105, 140, 150], "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
    response = requests.post(f"{server}/generate", headers=HEADERS, json=body, stream=True, timeout=60)
    lines = response.iter_lines()
    first = next(line for line in lines if line.startswith(b"data:"))
    import json

    job_id = json.loads(first[5:])["meta_info"]["job_id"]
    response.close()  # the client goes away mid-stream
    job = stack.wait(job_id, timeout=30)
    assert job["status"] == "cancelled"
    assert len(job["result"]["choices"][0]["token_ids"]) < 1500


def test_leaving_the_events_stream_cancels_nothing(stack, server):
    job = stack.submit({"token_ids": [106, 140], "sampling_params": {"max_tokens": 300, "temperature": 0,
                                                                     "ignore_eos": True}})
    response = requests.get(f"{server}/v1/jobs/{job['id']}/events", headers=HEADERS, stream=True, timeout=60)
    next(m for m in messages(response) if m.event == "tokens")
    response.close()
    assert stack.wait(job["id"], timeout=60)["status"] == "succeeded"


def test_the_python_client_streams_a_job_and_the_cli_follows_one(stack, server, capsys):
    from rollout_queue_client import RolloutClient
    from rollout_queue_client.follow_cli import follow_command

    with RolloutClient(server, API_KEY) as client:
        stream = client.stream({"token_ids": [107, 140, 150], "sampling_params": GREEDY})  # stream_events: true
        events = list(stream)
    kinds = [event["event"] for event in events]
    assert kinds[0] == "status" and kinds[-1] == "result" and "tokens" in kinds
    [choice] = stream.result["result"]["choices"]
    streamed = [t for e in events if e["event"] == "tokens" for c in e["data"]["choices"] for t in c["token_ids"]]
    assert streamed == choice["token_ids"]
    assert stream.token_ids[0] == choice["token_ids"] and stream.text[0] == choice["text"]

    import argparse

    args = argparse.Namespace(url=server, api_key=API_KEY, job_id=stream.job_id, tokens=True, last_event_id=None)
    assert follow_command(args) == 0
    printed = capsys.readouterr()
    assert [int(t) for t in printed.out.split()] == choice["token_ids"]
    assert "[succeeded: finish_reason length]" in printed.err


def test_streamed_text_adds_up_to_the_result_text_cut_at_a_stop_string(stack, server):
    body = {"token_ids": [108, 140, 150], "sampling_params": {"max_tokens": 40, "temperature": 0, "ignore_eos": True}}
    free = stack.wait(stack.submit(body)["id"])["result"]["choices"][0]["text"]
    # Long enough to span several tokens: its first ones are decoded before the match is known.
    stop = free[len(free) // 2:len(free) // 2 + 12]
    assert len(stop) == 12
    # stream_events: tokens are written only for a job someone reads, and this one may end before
    # the GPU worker sees a reader that opens after the POST.
    job = stack.submit({**body, "stream_events": True, "sampling_params": {**body["sampling_params"], "stop": [stop]}})
    events = follow(server, job["id"])
    [choice] = events[-1].json()["result"]["choices"]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    streamed = "".join(c.get("text", "") for m in events if m.event == "tokens" for c in m.json()["choices"])
    assert streamed == choice["text"]
