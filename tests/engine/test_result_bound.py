"""engine/result_bound.py against real results: jobs of the demo model run by the engine, stored as
the GPU worker stores them (``domain.jobs.results.engine_result``, ``finite_json.compact``), never
pass their bound, and the bound is not loose past a small factor where nothing compresses."""

from __future__ import annotations

import pytest

from domain.infra.finite_json import compact
from domain.jobs.request import sampling_params
from domain.jobs.results import engine_result
from engine.generation import GenerationRequest
from engine.result_bound import (
    ResultTooLargeError,
    check_result_size,
    mask_support_bound,
    request_result_bound,
    result_bytes_bound,
)
from engine.scoring import ScoreRequest

API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "n": 1, "ignore_eos": True,
                "logprobs": True, "seed": 7}
PROMPT = [10, 11, 12, 13, 14, 15, 16, 17] * 4


def stored_bytes(engine, params: dict) -> int:
    (output,) = engine.generate([GenerationRequest(PROMPT, sampling_params(params))])
    result = engine_result(output, kind="generate", prompt_token_ids=PROMPT, placeholder_ranges=[],
                           weight_version=engine.weight_version, transport="inline",
                           timings={"queue_s": 0.1, "prefill_s": 0.2, "decode_s": 0.3},
                           nodes={"preprocess": "node-a", "generate": "node-a/gpu-0"})
    return len(compact(result).encode())


@pytest.mark.parametrize(("knobs", "loosest"), [
    ({"max_tokens": 48, "n": 2}, 10),
    ({"max_tokens": 48, "n": 2, "top_logprobs": 5}, 4),
    ({"max_tokens": 32, "prompt_logprobs": 4, "top_logprobs": 2}, 4),
    ({"max_tokens": 32, "temperature": 0.0, "sampling_mask": True}, 10),
    ({"max_tokens": 32, "top_k": 40, "sampling_mask": True, "top_logprobs": 1}, 5),
    ({"max_tokens": 32, "sampling_mask": True}, None),  # every id a token: deflates to nearly nothing
])
def test_a_real_result_never_passes_its_bound(engine, knobs, loosest):
    params = {**API_DEFAULTS, **knobs}
    stored = stored_bytes(engine, params)
    bound = result_bytes_bound(params, prompt_tokens=len(PROMPT), vocab_size=engine.loaded.vocab_size)
    assert stored <= bound
    if loosest is not None:
        assert bound <= loosest * stored, (bound, stored)


def test_a_score_result_never_passes_its_bound(engine):
    completion = [20, 21, 22, 23] * 8
    (output,) = engine.score([ScoreRequest(PROMPT, completion)])
    stored = len(compact(engine_result(output, kind="score", prompt_token_ids=PROMPT, placeholder_ranges=[],
                                       weight_version="v" * 128, transport="inline", timings={})).encode())
    request = {"kind": "score", "token_ids": PROMPT, "completion_token_ids": completion}
    assert stored <= request_result_bound(request, context_tokens=None, vocab_size=engine.loaded.vocab_size)


def test_the_issues_masked_job_passes_the_default_limit_an_ordinary_one_does_not():
    """#56: n=8 × 4,000 tokens with a sampling mask on a 640-id vocabulary made a 190 MB record."""
    limit = 32 * 1024 * 1024
    masked = {**API_DEFAULTS, "n": 8, "max_tokens": 4000, "sampling_mask": True}
    with pytest.raises(ResultTooLargeError) as refused:
        check_result_size(result_bytes_bound(masked, prompt_tokens=100, vocab_size=640), limit)
    assert refused.value.errors["max_result_bytes"] == limit and "ROLLOUT_MAX_RESULT_BYTES" in refused.value.message
    rollout = {**API_DEFAULTS, "n": 8, "max_tokens": 4000, "top_logprobs": 5}
    check_result_size(result_bytes_bound(rollout, prompt_tokens=2000, vocab_size=152_000), limit)
    check_result_size(result_bytes_bound({**masked, "top_k": 20}, prompt_tokens=100, vocab_size=152_000), limit)


def test_the_masks_support_is_what_its_truncation_lets_through():
    assert mask_support_bound({"temperature": 0.0}, 640) == 1
    assert mask_support_bound({"temperature": 1.0, "top_k": 20}, 640) == 20
    assert mask_support_bound({"temperature": 1.0, "top_k": 5000}, 640) == 640
    assert mask_support_bound({"temperature": 1.0, "top_k": -1, "top_p": 0.5}, 640) == 640  # a flat distribution


def test_a_prompt_not_tokenized_yet_is_counted_at_its_most():
    params = {**API_DEFAULTS, "max_tokens": 10, "prompt_logprobs": 0}
    text = request_result_bound({"prompt": "é" * 100, "sampling_params": params}, context_tokens=None, vocab_size=640)
    ids = request_result_bound({"token_ids": [1] * 200, "sampling_params": params}, context_tokens=None,
                               vocab_size=640)
    assert text >= ids  # 200 UTF-8 bytes: at most 200 tokens, and a template's few
    media = {"token_ids": [1], "content_parts": [{"type": "image_url"}], "sampling_params": params}
    assert (request_result_bound(media, context_tokens=4096, vocab_size=640)
            > request_result_bound({**media, "content_parts": []}, context_tokens=4096, vocab_size=640))


def test_routed_experts_count_in_the_bound(tmp_path):
    """#59: a result with routed experts never passes its bound (every position × MoE layers × k,
    packed), and a long MoE rollout asking for them is counted for them."""
    from transformers import AutoConfig

    from engine.demo_model import build_demo_model
    from engine.generation import Engine
    from engine.loading import load_model
    from engine.routing.shape import routing_shape

    directory = build_demo_model(tmp_path / "qwen3_moe", arch="qwen3_moe")
    engine = Engine(load_model(str(directory), device="cpu"))
    shape = routing_shape(AutoConfig.from_pretrained(directory))
    assert (shape.layers, shape.top_k, shape.num_experts, shape.bytes_per_token) == (2, 2, 8, 4)
    params = {**API_DEFAULTS, "max_tokens": 24, "n": 2, "routed_experts": True}
    stored = stored_bytes(engine, params)
    bound = result_bytes_bound(params, prompt_tokens=len(PROMPT), vocab_size=engine.loaded.vocab_size,
                               routed_bytes_per_token=shape.bytes_per_token)
    plain = result_bytes_bound({**params, "routed_experts": False}, prompt_tokens=len(PROMPT),
                               vocab_size=engine.loaded.vocab_size, routed_bytes_per_token=shape.bytes_per_token)
    assert stored <= bound and bound - plain >= 2 * (len(PROMPT) + 23) * 4 * 4 // 3
    # Qwen3-30B-A3B: 48 MoE layers, top 8 of 128: 384 bytes a position, 32k positions of 8 choices.
    big = {**API_DEFAULTS, "max_tokens": 30_000, "n": 8, "routed_experts": True}
    with pytest.raises(ResultTooLargeError):
        check_result_size(result_bytes_bound(big, prompt_tokens=2000, vocab_size=152_000,
                                             routed_bytes_per_token=384), 32 * 1024 * 1024)
