"""Routed experts through a real stack (#59 item 5): the API over HTTP, Redis and a GPU worker on
the MoE demo, asked as the RL frameworks ask, decoded as they decode, and equal to the top-k of
transformers' own router logits over the same tokens.

- slime (``slime/rollout/sglang_rollout.py``): SGLang ``/generate`` with ``input_ids``,
  ``return_logprob`` and ``return_routed_experts: true``; ``meta_info.routed_experts`` decoded as
  ``np.frombuffer(pybase64.b64decode(...), dtype=np.int32).reshape(len(tokens) - 1, num_layers, topk)``.
- verl's SGLang path (its R3 usage notes): the same flag on a batch of prompts, ``reshape(-1, layers, k)``.
- vLLM's server flag (``--enable-return-routed-experts``; verl's and SkyRL's vLLM rollouts send no
  per-request flag): here ``ROLLOUT_RETURN_ROUTED_EXPERTS``, read from ``choices[].routed_experts``
  of the token-in-token-out route.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import requests
import torch

from domain.infra.redis_server import EmbeddedRedis
from tests.e2e.conftest import API_KEY, build_stack, log_dir_for, make_stack_env
from tests.e2e.dialect_server import serve

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [100, 101, 102, 103, 104, 105]
LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from engine.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("moe-e2e") / "qwen3_moe", arch="qwen3_moe")


@pytest.fixture(scope="module")
def stack(moe_dir, loopback_host, tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("moe-redis"), persistent=False).start()
    env = make_stack_env(redis_url=server.url, model_dir=moe_dir, state_dir=tmp_path_factory.mktemp("moe"),
                         loopback=loopback_host, node_id="moe-node", ROLLOUT_RETURN_ROUTED_EXPERTS="true")
    try:
        with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "moe"), workers=("gpu",)) as built:
            yield built
    finally:
        server.stop()


@pytest.fixture(scope="module")
def base(stack):
    with serve(stack) as (url, _):
        yield url


@pytest.fixture(scope="module")
def reference(moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()

    def experts(token_ids) -> np.ndarray:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(token_ids)]), output_router_logits=True)
        return np.stack([torch.topk(torch.softmax(x, dim=-1), TOP_K, dim=-1).indices.numpy()
                         for x in out.router_logits], axis=1)

    return experts


def test_slime_sglang_generate(base, reference):
    payload = {"input_ids": PROMPT, "return_logprob": True, "return_routed_experts": True,
               "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                   "sampling_seed": 5, "ignore_eos": True, "no_stop_trim": True,
                                   "skip_special_tokens": False, "spaces_between_special_tokens": False}}
    output = requests.post(f"{base}/generate", json=payload, headers=AUTH, timeout=60).json()
    tokens = PROMPT + output["output_ids"]  # slime's sample.tokens
    routed = np.frombuffer(base64.b64decode(output["meta_info"]["routed_experts"].encode("ascii")),
                           dtype=np.int32).reshape(len(tokens) - 1, LAYERS, TOP_K)
    np.testing.assert_array_equal(routed, reference(tokens[:-1]))
    # SGLang's routed_experts_start_len (a next turn asks for its new part only): the same seed, from there.
    later = requests.post(f"{base}/generate", json={**payload, "routed_experts_start_len": len(PROMPT)},
                          headers=AUTH, timeout=60).json()
    tail = np.frombuffer(base64.b64decode(later["meta_info"]["routed_experts"]), dtype=np.int32)
    np.testing.assert_array_equal(tail.reshape(-1, LAYERS, TOP_K), routed[len(PROMPT):])


def test_verl_sglang_batch(base, reference):
    prompts = [PROMPT, PROMPT[:3] + [200, 201]]
    payload = {"input_ids": prompts, "return_routed_experts": [True, False],
               "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    first, second = requests.post(f"{base}/generate", json=payload, headers=AUTH, timeout=60).json()
    raw = base64.b64decode(first["meta_info"]["routed_experts"])
    routed = torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy()).reshape(-1, LAYERS, TOP_K).numpy()
    np.testing.assert_array_equal(routed, reference(prompts[0] + first["output_ids"][:-1]))
    assert "routed_experts" not in second["meta_info"]  # that prompt did not ask


def test_vllm_server_flag_on_token_in_token_out(base, reference):
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 8, "n": 2,
                                                     "ignore_eos": True}}
    reply = requests.post(f"{base}/inference/v1/generate", json=body, headers=AUTH, timeout=60).json()
    for choice in reply["choices"]:  # asked by no request field: the server's setting
        np.testing.assert_array_equal(np.array(choice["routed_experts"]),
                                      reference(PROMPT + choice["token_ids"][:-1]))
    off = {**body, "sampling_params": {**body["sampling_params"], "return_routed_experts": False}}
    reply = requests.post(f"{base}/inference/v1/generate", json=off, headers=AUTH, timeout=60).json()
    assert all(choice["routed_experts"] is None for choice in reply["choices"])


def test_native_packed_ids_and_their_shape(stack, reference):
    reply = stack.client.post("/v1/generate", json={"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 4, "temperature": 0, "ignore_eos": True, "routed_experts": True}}, headers=stack.headers())
    assert reply.status_code == 200, reply.get_json()
    [choice] = reply.get_json()["choices"]
    packed = choice["routed_experts"]
    assert packed["dtype"] == "uint8" and packed["shape"] == [len(PROMPT) + 3, LAYERS, TOP_K]
    ids = np.frombuffer(base64.b64decode(packed["data"]), dtype=np.uint8).reshape(packed["shape"])
    np.testing.assert_array_equal(ids, reference(PROMPT + choice["token_ids"][:-1]))


def test_streams_send_them_once_on_each_choices_last_chunk(base, reference):
    """A stream carries no routing per token: the whole choice's comes on its last chunk."""
    import json

    body = {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": 5, "temperature": 0,
                                                                     "ignore_eos": True}}
    with requests.post(f"{base}/inference/v1/generate", json=body, headers=AUTH, stream=True, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    tokens = [t for chunk in chunks for choice in chunk["choices"] for t in choice.get("token_ids") or []]
    carrying = [choice for chunk in chunks for choice in chunk["choices"] if choice.get("routed_experts")]
    assert len(carrying) == 1 and carrying[0] is chunks[-1]["choices"][0]
    np.testing.assert_array_equal(np.array(carrying[0]["routed_experts"]), reference(PROMPT + tokens[:-1]))

    sglang = {"input_ids": PROMPT, "stream": True, "return_routed_experts": True,
              "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with requests.post(f"{base}/generate", json=sglang, headers=AUTH, stream=True, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    carrying = [chunk for chunk in chunks if "routed_experts" in chunk["meta_info"]]
    assert carrying == [chunks[-1]]
    ids = np.frombuffer(base64.b64decode(chunks[-1]["meta_info"]["routed_experts"]), dtype=np.int32)
    np.testing.assert_array_equal(ids.reshape(-1, LAYERS, TOP_K), reference(PROMPT + chunks[-1]["output_ids"][:-1]))


def test_a_score_job_returns_every_scored_positions_experts(stack, reference):
    completion = [110, 111, 112, 113]
    job = stack.submit({"kind": "score", "token_ids": PROMPT, "completion_token_ids": completion,
                        "sampling_params": {"routed_experts": True}})
    result = stack.wait(job["id"])["result"]
    packed = result["routed_experts"]
    assert packed["shape"] == [len(PROMPT) + len(completion), LAYERS, TOP_K]
    ids = np.frombuffer(base64.b64decode(packed["data"]), dtype=np.uint8).reshape(packed["shape"])
    np.testing.assert_array_equal(ids, reference(PROMPT + completion))
