"""Routed experts (#59, engine/routing/): every position a row fed to the model carries the top-k
expert ids of every MoE layer, equal to the top-k of transformers' own router logits
(``output_router_logits``) in a teacher-forced forward over the same tokens; prompt positions found
in the prefix cache are computed again; rows that did not ask carry nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.capacity import SchedulerLimits
from engine.errors import InvalidRequestError
from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.routing.encoding import nested, sglang_base64, unpack
from engine.sampling_params import SamplingParams

LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from engine.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe")


@pytest.fixture(scope="module")
def engine(moe_dir):
    return Engine(load_model(str(moe_dir), device="cpu"))


@pytest.fixture(scope="module")
def reference(moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()

    def experts(token_ids) -> np.ndarray:
        """(len, layers, k): the top-k of each MoE layer's router logits, the model's own rule."""
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(token_ids)]), output_router_logits=True)
        return np.stack([torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1).indices.numpy()
                         for logits in out.router_logits], axis=1)

    return experts


def _ids(engine, text: str) -> list[int]:
    return engine.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def _assert_routing(choice, prompt, reference) -> None:
    packed = choice.routed_experts
    fed = [*prompt, *choice.token_ids[:-1]]
    assert packed["dtype"] == "uint8" and packed["shape"] == [len(fed), LAYERS, TOP_K]
    got = unpack(packed)
    np.testing.assert_array_equal(got, reference(fed))


def test_generation_routing_is_the_routers_own_top_k(engine, reference):
    prompt = _ids(engine, "The quick brown fox jumps over the lazy dog.")
    other = _ids(engine, "Count the objects in the picture.")
    routed = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, ignore_eos=True, routed_experts=True)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, routed_experts=True)
    plain = SamplingParams(max_tokens=7, temperature=1.0, seed=4, ignore_eos=True)
    results = engine.generate([GenerationRequest(prompt, routed), GenerationRequest(other, plain),
                               GenerationRequest(other, greedy)])
    for choice in results[0].choices:
        _assert_routing(choice, prompt, reference)
    assert results[1].choices[0].routed_experts is None  # it did not ask
    _assert_routing(results[2].choices[0], other, reference)


def test_cached_prefix_routing_is_computed_again(engine, reference):
    engine.forget_cached()
    size = engine.kv_pool.block_size
    prompt = _ids(engine, "Rollouts are scored offline; every job carries a seed so that results can be "
                          "reproduced. " * 3)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [first] = engine.generate([GenerationRequest(prompt, greedy)])[0].choices  # did not ask: none recorded
    turn = [*prompt, *first.token_ids, *_ids(engine, " Then say it again.")]
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=9, ignore_eos=True, routed_experts=True)
    second = engine.generate([GenerationRequest(turn, params)])[0]
    assert second.cached_tokens >= size
    _assert_routing(second.choices[0], turn, reference)
    again = engine.generate([GenerationRequest(turn, params)])[0]  # found whole: no prefill at all
    assert again.cached_tokens == len(turn)
    _assert_routing(again.choices[0], turn, reference)


def test_chunked_prefill_routing_while_rows_decode(engine, reference):
    engine.forget_cached()
    long_prompt = _ids(engine, "The weather today is sunny with a light breeze from the west. " * 4)
    short = _ids(engine, "Yes. No. Maybe.")
    scheduler = engine.scheduler(limits=SchedulerLimits(prefill_chunk_tokens=16, prompt_cache_tokens=0))
    scheduler.submit(GenerationRequest(short, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                             routed_experts=True)), tag="short")
    scheduler.step()
    scheduler.submit(GenerationRequest(long_prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                                   routed_experts=True)), tag="long")
    results, steps = {}, 0
    while scheduler.has_work:
        steps += 1
        for finished in scheduler.step():
            assert finished.error is None, finished.error
            results[finished.tag] = finished.result
    assert engine.stats.prefill_forwards >= 4  # the long prompt went in chunks
    _assert_routing(results["long"].choices[0], long_prompt, reference)
    _assert_routing(results["short"].choices[0], short, reference)


def test_dialect_encodings_of_the_same_ids(engine):
    prompt = _ids(engine, "A picture is worth a thousand words.")
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, routed_experts=True)
    packed = engine.generate([GenerationRequest(prompt, params)])[0].choices[0].routed_experts
    ids = unpack(packed)
    import base64

    sglang = np.frombuffer(base64.b64decode(sglang_base64(packed)), dtype=np.int32)
    np.testing.assert_array_equal(sglang.reshape(len(prompt) + 2, LAYERS, TOP_K), ids)
    assert nested(packed) == ids.tolist()


def test_a_model_without_moe_layers_refuses(tmp_path):
    from engine.demo_model import build_demo_model

    dense = Engine(load_model(str(build_demo_model(tmp_path / "qwen2_vl", arch="qwen2_vl")), device="cpu"))
    with pytest.raises(InvalidRequestError) as caught:
        dense.generate([GenerationRequest([1, 2, 3], SamplingParams(max_tokens=2, routed_experts=True))])
    assert caught.value.errors == {"routed_experts": ["this model has no MoE layers"]}


def test_a_row_across_an_update_keeps_each_positions_weights(moe_dir, tmp_path, reference):
    """A row kept across a weight update (``recompute_kv``): the positions fed before the update
    carry the old weights' experts, those fed after the new weights' (over the whole sequence,
    whose KV the new weights computed again); a position computed again keeps its first record."""
    from transformers import AutoModelForCausalLM

    from engine.demo_model import build_demo_model

    new_dir = build_demo_model(tmp_path / "qwen3_moe", arch="qwen3_moe", seed=1)
    engine = Engine(load_model(str(moe_dir), device="cpu"))
    prompt = _ids(engine, "Please answer briefly. The answer is four.")
    at, tokens = 3, 7
    scheduler = engine.scheduler()
    handle = scheduler.submit(GenerationRequest(prompt, SamplingParams(max_tokens=tokens, temperature=0,
                                                                       ignore_eos=True, routed_experts=True)))
    finished = []
    while not finished and len(scheduler.tokens_so_far(handle)[0].token_ids) < at:
        finished = scheduler.step()
    engine.update_weights(new_dir, weight_version="step-1")
    scheduler.weights_changed(recompute_kv=True)
    while not finished:
        finished = scheduler.step()
    [choice] = finished[0].result.choices
    fed = [*prompt, *choice.token_ids[:-1]]
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = new_model(input_ids=torch.tensor([fed]), output_router_logits=True).router_logits
    new = np.stack([torch.topk(torch.softmax(x, dim=-1), TOP_K, dim=-1).indices.numpy() for x in logits], axis=1)
    old = reference(fed)
    cut = len(prompt) + at - 1  # the first position the new weights computed: token `at - 1` fed
    got = unpack(choice.routed_experts)
    np.testing.assert_array_equal(got[:cut], old[:cut])
    np.testing.assert_array_equal(got[cut:], new[cut:])
    assert not np.array_equal(old[cut:], new[cut:])  # the two weights route differently there


def test_scoring_routing_covers_every_position(engine, reference):
    from engine.scoring import ScoreRequest

    prompt = _ids(engine, "What colour is the square in the picture?")
    completion = _ids(engine, " a red square on a blue background")
    short = _ids(engine, "Yes.")
    scored = engine.score([ScoreRequest(prompt, completion, routed_experts=True),
                           ScoreRequest(short, _ids(engine, " No."))])
    packed = scored[0].routed_experts
    assert packed["shape"] == [len(prompt) + len(completion), LAYERS, TOP_K]
    np.testing.assert_array_equal(unpack(packed), reference([*prompt, *completion]))
    assert scored[1].routed_experts is None


def test_a_preempted_row_keeps_its_routing_across_its_resume(moe_dir, reference, monkeypatch):
    """A request preempted for another key's share resumes with its rows' KV computed again
    (engine/preemption.py): the positions recorded before keep their first record, and every
    position's ids still equal the router's top-k over its tokens."""
    import dataclasses

    from engine import preemption

    engine = Engine(load_model(str(moe_dir), device="cpu"), SchedulerLimits(kv_cache_tokens=4 * 16,
                                                                            kv_block_tokens=16))
    params = {"temperature": 1.0, "ignore_eos": True, "routed_experts": True}
    requests = [dataclasses.replace(GenerationRequest(_ids(engine, "First."), SamplingParams(
                    max_tokens=40, seed=1, **params)), tenant="a"),
                dataclasses.replace(GenerationRequest(_ids(engine, "Second."), SamplingParams(
                    max_tokens=28, seed=2, **params)), tenant="b")]
    engine.usage.half_life_s = 0
    real, forced = preemption.fair_share_victim, []

    def once_the_oldest_running(waiting, need, shares, running, tenants, usage):
        if running and not forced:
            forced.append(running[0])
            return 0
        return real(waiting, need, shares, running, tenants, usage)

    monkeypatch.setattr(preemption, "fair_share_victim", once_the_oldest_running)
    results = engine.generate(requests)
    assert engine.stats.preempted_requests == 1
    for request, result in zip(requests, results, strict=True):
        _assert_routing(result.choices[0], list(request.prompt_token_ids), reference)


def test_the_vision_moe_routes_image_prompts_as_its_own_forward(tmp_path):
    """Qwen3-VL-MoE: an image prompt's positions (its image pads included) and its output tokens
    carry the top-k of the model's own router logits over the same ids and pixels."""
    from transformers import AutoModelForImageTextToText

    from engine.demo_model import build_demo_model
    from processors.registry import load_processor
    from tests.fidelity import make_prompt

    directory = build_demo_model(tmp_path / "qwen3_vl_moe", arch="qwen3_vl_moe")
    engine = Engine(load_model(str(directory), device="cpu"))
    processor = load_processor(directory)
    prompt = make_prompt(processor, "image")
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=2, ignore_eos=True, routed_experts=True)
    [choice] = engine.generate([GenerationRequest(prompt.token_ids, params, items=prompt.items)])[0].choices
    fed = [*prompt.token_ids, *choice.token_ids[:-1]]
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    features = {name: torch.cat([item.features[name] for item in prompt.items]) for name in prompt.items[0].features}
    ids = torch.tensor([fed])
    types = torch.tensor(processor.hf.create_mm_token_type_ids(ids.tolist()))
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                    output_router_logits=True, **features)
    want = np.stack([torch.topk(torch.softmax(x.float(), dim=-1), TOP_K, dim=-1).indices.numpy()
                     for x in out.router_logits], axis=1)
    got = unpack(choice.routed_experts)
    assert got.shape == (len(fed), LAYERS, TOP_K)
    np.testing.assert_array_equal(got, want)
