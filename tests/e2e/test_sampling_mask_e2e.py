"""Sampling masks, processed logprobs and vLLM's prompt fields through a real stack (#51 items 4
and 5): the same seeded request on the native, vLLM and SGLang routes (plain and streamed) gets the
same tokens and the same masks, and each mask is the reference one: a greedy token's is the token
alone; a seeded top_k=5 token's is the 5 most likely ids of its raw distribution (read from
top_logprobs), holding the drawn token; a processed logprob is the raw one renormalized over it."""

from __future__ import annotations

import math

import pytest
import requests

from tests.e2e.conftest import API_KEY
from tests.e2e.dialect_server import serve
from tests.e2e.sse import messages
from tests.e2e.test_jobs_e2e import image_data_url

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [100, 101, 102, 103]
TOP_K = {"max_tokens": 6, "temperature": 1.0, "top_k": 5, "seed": 11, "ignore_eos": True}


@pytest.fixture(scope="module")
def base(stack):
    with serve(stack) as (url, _):
        yield url


def _native(stack, params: dict) -> dict:
    reply = stack.client.post("/v1/generate", json={"token_ids": PROMPT, "sampling_params": params},
                              headers=stack.headers())
    assert reply.status_code == 200, reply.get_json()
    return reply.get_json()["choices"][0]


def _rows(mask: dict) -> list[list[int]]:
    offsets = mask["offsets"]
    return [mask["token_ids"][a:b] for a, b in zip(offsets, offsets[1:], strict=False)]


def test_greedy_masks_are_the_chosen_tokens(stack):
    choice = _native(stack, {"max_tokens": 5, "temperature": 0.0, "sampling_mask": True, "ignore_eos": True})
    assert _rows(choice["sampling_mask"]) == [[t] for t in choice["token_ids"]]
    assert len(choice["sampling_mask"]["offsets"]) == len(choice["token_ids"]) + 1


def test_top_k_masks_are_the_raw_top_k_and_processed_logprobs_renormalize_over_them(stack):
    raw = _native(stack, {**TOP_K, "sampling_mask": True, "top_logprobs": 5})
    processed = _native(stack, {**TOP_K, "logprobs_mode": "processed"})
    assert processed["token_ids"] == raw["token_ids"]  # the same seed draws the same tokens
    for token, row, top, lp, plp in zip(raw["token_ids"], _rows(raw["sampling_mask"]), raw["top_logprobs"],
                                        raw["logprobs"], processed["logprobs"], strict=True):
        assert len(row) <= 5 and token in row
        assert set(row) == {t for t, _ in top}  # no penalties, temperature 1: top-k of the raw distribution
        norm = math.log(sum(math.exp(v) for _, v in top))
        assert plp == pytest.approx(lp - norm, abs=1e-4)


def test_the_same_masks_on_the_vllm_and_sglang_routes(stack, base):
    native = _native(stack, {**TOP_K, "sampling_mask": True})
    vllm_body = {"token_ids": PROMPT, "sampling_params": {**TOP_K, "return_sampling_mask": True}}
    vllm = requests.post(f"{base}/inference/v1/generate", json=vllm_body, headers=AUTH, timeout=120).json()
    assert vllm["choices"][0]["token_ids"] == native["token_ids"]
    assert vllm["choices"][0]["sampling_mask"] == native["sampling_mask"]
    sglang_params = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 5, "sampling_seed": 11, "ignore_eos": True}
    sglang = requests.post(f"{base}/generate", json={"input_ids": PROMPT, "sampling_params": sglang_params,
                                                     "return_sampling_mask": True}, headers=AUTH, timeout=120).json()
    assert sglang["output_ids"] == native["token_ids"]
    assert sglang["meta_info"]["output_token_sampling_mask"] == _rows(native["sampling_mask"])


def _stream(base, path, body) -> list[dict]:
    with requests.post(f"{base}{path}", json={**body, "stream": True}, headers=AUTH, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        return [m.json() for m in messages(r) if m.data != "[DONE]"]


def test_streams_end_with_the_mask(stack, base):
    native = _native(stack, {**TOP_K, "sampling_mask": True})
    chunks = _stream(base, "/inference/v1/generate", {"token_ids": PROMPT, "return_token_ids": True,
                                                      "sampling_params": {**TOP_K, "return_sampling_mask": True}})
    assert chunks[0]["prompt_token_ids"] == PROMPT and chunks[0]["mm_placeholders"] == {}
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    assert chunks[-1]["choices"][0]["sampling_mask"] == native["sampling_mask"]
    sglang_params = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 5, "sampling_seed": 11, "ignore_eos": True}
    chunks = _stream(base, "/generate", {"input_ids": PROMPT, "sampling_params": sglang_params,
                                         "return_sampling_mask": True})
    assert chunks[-1]["meta_info"]["output_token_sampling_mask"] == _rows(native["sampling_mask"])


def test_openai_completions_carry_the_mask(stack, base):
    native = _native(stack, {**TOP_K, "sampling_mask": True})
    model = requests.get(f"{base}/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, **TOP_K, "return_sampling_mask": True}
    plain = requests.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=120).json()
    assert plain["choices"][0]["sampling_mask"] == native["sampling_mask"]
    chunks = [c for c in _stream(base, "/v1/completions", body) if c["choices"]]
    assert chunks[-1]["choices"][0]["sampling_mask"] == native["sampling_mask"]
    assert all("sampling_mask" not in c["choices"][0] for c in chunks[:-1])


def test_vllm_reply_names_the_media_runs_it_expanded(base):
    render = requests.post(f"{base}/v1/chat/completions/render", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url()}},
                                                  {"type": "text", "text": "What colour?"}]}]}).json()
    body = {"token_ids": render["token_ids"], "features": render["features"], "return_token_ids": True,
            "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
    reply = requests.post(f"{base}/inference/v1/generate", json=body, headers=AUTH, timeout=120).json()
    (run,) = reply["mm_placeholders"]["image"]
    assert run["length"] == 4  # a 64x48 image is 4 tokens on the demo model
    assert reply["mm_placeholders"] == render["features"]["mm_placeholders"]
    first = _stream(base, "/inference/v1/generate", body)[0]
    assert first["prompt_token_ids"] == reply["prompt_token_ids"] and first["mm_placeholders"] == reply["mm_placeholders"]
