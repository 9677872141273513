"""SGLang's /generate and small routes, over HTTP, with bodies built the way slime builds them
(slime/rollout/sglang_rollout.py: sampling_params with nulls, return_logprob, input_ids or text +
image_data) and replies read the way its parser reads them (meta_info.output_token_logprobs as
[logprob, token_id, text], finish_reason.type)."""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time

import pytest
import requests

from tests.e2e.conftest import API_KEY, OTHER_KEY
from tests.e2e.dialect_server import serve
from tests.e2e.test_jobs_e2e import image_data_url

AUTH = {"Authorization": f"Bearer {API_KEY}"}
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What colour?"


def slime_sampling_params(max_new_tokens: int) -> dict:
    # What slime's GenerateState sends with its default arguments: stop and stop_token_ids None.
    return {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens, "stop": None,
            "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
            "spaces_between_special_tokens": False}


@pytest.fixture(scope="module")
def base(stack):
    with serve(stack) as (url, _):
        yield url


def post(base, path, body, key=API_KEY):
    return requests.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def native(stack, body):
    response = stack.client.post("/v1/generate", json=body, headers=stack.headers())
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def test_slime_token_body_and_parser(base, stack):
    payload = {"sampling_params": slime_sampling_params(5), "return_logprob": True, "input_ids": [311, 312, 313]}
    output = post(base, "/generate", payload).json()
    # slime's parser, verbatim in spirit:
    tokens = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
    log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
    assert len(tokens) == 5 and output["output_ids"] == tokens and all(lp <= 0 for lp in log_probs)
    meta = output["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 5, 0)
    assert meta["e2e_latency"] > 0 and isinstance(output["text"], str)
    again = post(base, "/generate", payload).json()["meta_info"]
    assert again["cached_tokens"] > 0, "the same prompt again reuses its KV, as SGLang's radix cache reports"
    reference = native(stack, {"token_ids": [311, 312, 313],
                               "sampling_params": {"max_tokens": 5, "temperature": 0, "skip_special_tokens": False,
                                                   "spaces_between_special_tokens": False}})
    assert reference["choices"][0]["token_ids"] == tokens
    assert reference["choices"][0]["logprobs"] == pytest.approx(log_probs, abs=1e-6)
    # Every call is a job of the caller's key, with the weight version that served it.
    job = stack.client.get(f"/v1/jobs/{meta['job_id']}", headers=stack.headers()).get_json()
    assert job["status"] == "succeeded" and job["result"]["weight_version"] == meta["weight_version"]
    assert stack.client.get(f"/v1/jobs/{meta['job_id']}", headers=stack.headers(OTHER_KEY)).status_code == 404
    assert "output_token_logprobs" not in post(base, "/generate", {**payload, "return_logprob": None}).json()[
        "meta_info"]


def test_batches_and_n_keep_their_order(base):
    prompts = [[101, 102], [104, 105, 106]]
    out = post(base, "/generate", {"input_ids": prompts, "rid": ["a", "b"],
                                   "sampling_params": [{"max_new_tokens": 2, "temperature": 0},
                                                       {"max_new_tokens": 3, "temperature": 0}]}).json()
    assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["a", "b"]
    assert [len(o["output_ids"]) for o in out] == [2, 3] and [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3]
    texts = post(base, "/generate", {"text": ["Hello", "Hi there"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert len(texts) == 2
    group = post(base, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "n": 2,
                                                                         "sampling_seed": 5}}).json()
    assert isinstance(group, list) and len(group) == 2 and len({o["meta_info"]["job_id"] for o in group}) == 1


def test_image_data_as_data_url_and_raw_base64_agree(base):
    url = image_data_url(color=(20, 200, 90))
    raw = url.split(",", 1)[1]
    body = {"text": IMAGE_PROMPT, "sampling_params": slime_sampling_params(4), "return_logprob": True}
    by_url = post(base, "/generate", {**body, "image_data": [url]}).json()
    by_raw = post(base, "/generate", {**body, "image_data": raw}).json()
    text_only = post(base, "/generate", {**body, "text": "What colour?"}).json()
    # vision start + end, and the one placeholder expanded to the 64x48 image's 4 tokens
    assert by_url["meta_info"]["prompt_tokens"] == text_only["meta_info"]["prompt_tokens"] + 6
    assert by_raw["output_ids"] == by_url["output_ids"]
    assert by_raw["meta_info"]["prompt_tokens"] == by_url["meta_info"]["prompt_tokens"]
    batch = post(base, "/generate", {"text": [IMAGE_PROMPT, "No image"], "image_data": [[raw], None],
                                     "sampling_params": {"max_new_tokens": 2}}).json()
    assert batch[0]["meta_info"]["prompt_tokens"] == by_url["meta_info"]["prompt_tokens"]
    not_media = post(base, "/generate", {**body, "image_data": "./cat.png"})
    assert not_media.status_code == 422 and not_media.json()["error"]["message"].startswith("image_data[0]")


def test_logprob_options_stop_reasons_and_texts(base, stack):
    prompt = [101, 102, 103, 104]
    first = post(base, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4,
                                                                              "temperature": 0}}).json()
    stop_id = first["output_ids"][1]
    out = post(base, "/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                   "top_logprobs_num": 2, "return_text_in_logprobs": True,
                                   "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                       "stop_token_ids": [stop_id]}}).json()
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop_id} and out["output_ids"][-1] == stop_id
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == prompt and inputs[0][0] is None and all(lp < 0 for lp, _, _ in inputs[1:])
    assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])
    assert all(len(step) == 2 for step in meta["output_top_logprobs"])
    # The sampled (greedy) token is the most likely one of the raw distribution.
    assert [step[0][1] for step in meta["output_top_logprobs"]] == out["output_ids"]
    text_stop = post(base, "/generate", {"text": "Hello", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "stop": first_text_piece(base)}}).json()
    assert text_stop["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def first_text_piece(base) -> str:
    out = post(base, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    return out["text"][-2:] or "x"


def test_nulls_mean_defaults_and_unserved_knobs_are_named(base):
    body = {"input_ids": [101, 102], "text": None, "image_data": None, "rid": None, "return_logprob": None,
            "logprob_start_len": None, "top_logprobs_num": None, "stream": False, "lora_path": None,
            "sampling_params": {"max_new_tokens": 2, "temperature": None, "top_p": None, "regex": None,
                                "json_schema": None, "stop": None, "min_new_tokens": None}}
    assert post(base, "/generate", body).status_code == 200
    refused = post(base, "/generate", {**body, "sampling_params": {**body["sampling_params"], "stop_regex": "a+"}})
    assert refused.status_code == 422 and "sampling_params.stop_regex" in refused.json()["error"]["message"]
    unknown = post(base, "/generate", {**body, "input_idz": [1]})
    assert unknown.status_code == 422 and "input_idz" in unknown.json()["error"]["message"]
    assert post(base, "/generate", body, key="wrong").json()["error"]["code"] == "unauthorized"


def test_abort_all_cuts_only_the_callers_jobs(base, stack):
    replies = {}

    def long_generate():
        replies["out"] = post(base, "/generate", {"input_ids": [101, 102], "sampling_params": {
            "max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}, "rid": "long-1"}).json()

    thread = threading.Thread(target=long_generate)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        jobs = stack.client.get("/v1/jobs?status=generating", headers=stack.headers()).get_json()["data"]
        if any(job["request_id"] == "long-1" for job in jobs):
            break
        time.sleep(0.05)
    # Another key's job, queued behind ours: abort_all must leave it alone.
    other = stack.submit({"token_ids": [101, 103], "sampling_params": {"max_tokens": 5, "ignore_eos": True}},
                         key=OTHER_KEY)
    time.sleep(0.3)
    assert post(base, "/abort_request", {"abort_all": True}).status_code == 200
    thread.join(60)
    meta = replies["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < len(replies["out"]["output_ids"]) < 3000
    assert post(base, "/abort_request", {"rid": "nothing-by-that-id"}, key=OTHER_KEY).status_code == 200
    done = stack.wait(other["id"], key=OTHER_KEY)
    assert done["status"] == "succeeded" and len(done["result"]["choices"][0]["token_ids"]) == 5


def test_small_routes(base, stack):
    assert requests.get(f"{base}/health", headers=AUTH, timeout=10).status_code == 200
    assert requests.get(f"{base}/health", timeout=10).status_code == 401
    assert requests.get(f"{base}/health_generate", headers=AUTH, timeout=60).status_code == 200
    info = requests.get(f"{base}/get_model_info", headers=AUTH, timeout=10).json()
    served = post(base, "/generate", {"input_ids": [101], "sampling_params": {"max_new_tokens": 1}}).json()
    assert info["weight_version"] == served["meta_info"]["weight_version"] and info["is_generation"] is True
    server = requests.get(f"{base}/get_server_info", headers=AUTH, timeout=10).json()
    assert server["context_length"] == stack.services.limits.context_tokens
    post(base, "/generate", {"text": IMAGE_PROMPT, "image_data": image_data_url(color=(1, 2, 3)),
                             "sampling_params": {"max_new_tokens": 1}})
    cache = stack.services.mm_cache
    assert len(cache) > 0
    # It holds every key's entries (a key's uuid-only requests need its own): admin keys only, and
    # this stack has none.
    assert post(base, "/flush_cache", {}).status_code == 403
    assert len(cache) > 0


def test_past_the_sync_limit_is_a_504_and_the_job_is_cancelled(stack):
    with serve(stack, sync_timeout_max=0.05) as (url, _):  # far below 3,000 decode steps
        response = post(url, "/generate", {"input_ids": [101, 102], "rid": "too-slow", "sampling_params": {
            "max_new_tokens": 3000, "ignore_eos": True}})
    assert response.status_code == 504 and response.json()["error"]["code"] == "sync_timeout"
    jobs = stack.client.get("/v1/jobs", headers=stack.headers()).get_json()["data"]
    (job,) = [job for job in jobs if job["request_id"] == "too-slow"]
    assert stack.wait(job["id"])["status"] == "cancelled"


def test_a_client_that_hangs_up_has_its_jobs_cancelled(stack):
    """vLLM and SGLang abort a request whose client disconnects: a trainer's own timeout must not
    leave its jobs running for nobody. The image takes 2.5 s to fetch; the client leaves at 0.5 s."""
    image = base64.b64decode(image_data_url(color=(9, 8, 7)).split(",", 1)[1])
    url = stack.host.route("/slow-image.png", (200, {"Content-Type": "image/png"}, image, 2.5))
    body = json.dumps({"text": IMAGE_PROMPT, "image_data": url, "rid": "hung-up",
                       "sampling_params": {"max_new_tokens": 4}})
    with serve(stack) as (base_url, _):
        connection = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=0.5)
        connection.request("POST", "/generate", body=body, headers={**AUTH, "Content-Type": "application/json"})
        with pytest.raises(TimeoutError):
            connection.getresponse()
        connection.close()  # the client gives up
        jobs = stack.client.get("/v1/jobs", headers=stack.headers()).get_json()["data"]
        (job,) = [job for job in jobs if job["request_id"] == "hung-up"]
        # Without the check it would succeed once the image arrived.
        assert stack.wait(job["id"], timeout=30)["status"] == "cancelled"


def test_sglangs_own_example_small_ids_are_text(base):
    """SGLang's docs send ``{"input_ids": [1, 2, 3]}``: on the demo model (special and media tokens
    at the end of the vocabulary, as in real Qwen tokenizers) those are ordinary text tokens."""
    output = post(base, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert output.status_code == 200, output.json()
    assert output.json()["meta_info"]["prompt_tokens"] == 3
