"""An adapter is checked whole before anything changes (#58 item 1): each refusal is an
``adapter_invalid`` with its problem, and the adapters already served serve as before."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.lora.adapter_files import WEIGHTS_FILE
from engine.lora.errors import AdapterInvalidError, AdapterLimitError, AdapterNotFoundError
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def served(demo_model_dir, adapter_a):
    engine = Engine(load_model(str(demo_model_dir), device="cpu"), max_loras=2, max_lora_rank=8)
    engine.load_adapter("a@1", adapter_a)
    return engine


def _copy(adapter, tmp_path, *, config=None, tensors=None):
    out = tmp_path / "edited"
    shutil.copytree(adapter, out)
    if config is not None:
        current = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps(config(current)))
    if tensors is not None:
        save_file(tensors(load_file(out / WEIGHTS_FILE)), out / WEIGHTS_FILE)
    return out


def _first(tensors, which="A"):
    return next(name for name in sorted(tensors) if name.endswith(f"lora_{which}.weight"))


def _edit(tensors, name, value):
    return {**tensors, name: value}


CASES = {
    "rank_too_large": dict(config=lambda c: {**c, "r": 16}),
    "unsupported": dict(config=lambda c: {**c, "use_dora": True}),
    "bad_config": dict(config=lambda c: {**c, "r": "four"}),
    "non_finite": dict(tensors=lambda t: _edit(t, _first(t), torch.full_like(t[_first(t)], float("nan")))),
    "shape_mismatch": dict(tensors=lambda t: _edit(t, _first(t), t[_first(t)][:, :-1].contiguous())),
    "unknown_module": dict(tensors=lambda t: {k.replace("layers.0.", "layers.9."): v for k, v in t.items()}),
    "encoder_module": dict(tensors=lambda t: {"base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight":
                                              torch.zeros(4, 32), **t}),
}


def _first_logprobs(engine, prompts):
    request = GenerationRequest(prompts.text("still served as it was"), SamplingParams(max_tokens=3, temperature=0,
                                                                                     ignore_eos=True),
                                adapter="a@1")
    return engine.generate([request])[0].choices[0].logprobs


@pytest.mark.parametrize("problem", sorted(CASES))
def test_a_bad_adapter_is_refused_and_changes_nothing(served, adapter_a, tmp_path, prompts, problem):
    before = _first_logprobs(served, prompts)
    bad = _copy(adapter_a, tmp_path, **CASES[problem])
    with pytest.raises(AdapterInvalidError) as raised:
        served.load_adapter("a@1", bad)  # even over the served one of that id
    assert raised.value.code == "adapter_invalid" and raised.value.problem == problem
    assert served.adapter_ids == ["a@1"]
    assert _first_logprobs(served, prompts) == before


def test_the_directory_is_confined_under_the_root(served, adapter_a, adapters_root, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(adapter_a, root / "link")
    with pytest.raises(AdapterInvalidError) as raised:
        served.load_adapter("x@1", "link", root=root)
    assert raised.value.problem == "not_a_directory"
    with pytest.raises(AdapterInvalidError) as raised:
        served.load_adapter("x@1", adapter_a, root=root)
    assert raised.value.problem == "outside_root"
    with pytest.raises(AdapterInvalidError) as raised:
        served.load_adapter("x@1", tmp_path, root=tmp_path.parent)
    assert raised.value.problem == "missing_file"
    assert served.adapter_ids == ["a@1"]


def test_resident_adapters_are_bounded_and_an_unloaded_one_lets_its_rows_finish(served, adapter_b, prompts):
    served.load_adapter("b@1", adapter_b)
    with pytest.raises(AdapterLimitError) as raised:
        served.load_adapter("b@2", adapter_b)
    assert raised.value.code == "adapter_limit_reached"
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompt = prompts.text("running while its adapter is unloaded")
    [alone] = served.generate([GenerationRequest(prompt, params, adapter="b@1")])
    scheduler = served.scheduler()
    try:
        scheduler.submit(GenerationRequest(prompt, params, adapter="b@1"))
        finished = scheduler.step()
        assert served.unload_adapter("b@1")
        with pytest.raises(AdapterNotFoundError):  # new requests may no longer name it
            scheduler.check(GenerationRequest(prompt, params, adapter="b@1"))
        for version in (2, 3, 4):  # in-place updates while the row runs: each retires the one before
            served.load_adapter(f"b@{version}", adapter_b)
            finished += scheduler.step()
            assert served.unload_adapter(f"b@{version}")
        while scheduler.has_work:
            finished += scheduler.step()
    finally:
        scheduler.close()
    [done] = finished
    assert done.error is None and done.result.choices[0].token_ids == alone.choices[0].token_ids
    served.load_adapter("b@5", adapter_b)  # the retired ones no request holds are dropped
    assert served.adapter_ids == ["a@1", "b@5"] and served.loaded.adapters.resident() == ["a@1", "b@5"]
    assert served.unload_adapter("b@5")
    assert served.adapter_ids == ["a@1"]
