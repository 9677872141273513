"""In-place weight swaps: a swapped model equals a fresh load of the new weights, and a bad
directory is a typed error that leaves the model exactly as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoints import WeightsInvalidError
from engine.demo_model import build_demo_model
from engine.errors import Fault
from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams
from engine.weights import load_weights


@pytest.fixture(scope="module")
def new_weights_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("weights") / "demo-seed-1", seed=1)


@pytest.fixture(scope="module")
def untouched(demo_model_dir):
    """A model the bad-directory tests try to swap into (and must leave as it is)."""
    return load_model(str(demo_model_dir), device="cpu")


def _snapshot(loaded) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}


def _greedy(engine: Engine, prompt: list[int]) -> list[int]:
    [result] = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))])
    return result.choices[0].token_ids


def test_a_swapped_model_equals_a_fresh_load_of_the_new_weights(demo_model_dir, new_weights_dir, prompts):
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    fresh = Engine(load_model(str(new_weights_dir), device="cpu"))
    prompt = prompts.text("The quick brown fox jumps")
    before = _greedy(engine, prompt)
    swaps = []
    engine.on_weights_changed(swaps.append)

    swap = engine.update_weights(new_weights_dir, weight_version="step-1")

    assert engine.weight_version == "step-1" and swap.previous_version != "step-1"
    assert swaps == [swap] and swap.tensors == len(load_file(new_weights_dir / "model.safetensors"))
    ours, theirs = engine.loaded.model.state_dict(), fresh.loaded.model.state_dict()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    assert _greedy(engine, prompt) == _greedy(fresh, prompt) != before
    [result] = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=2))])
    assert result.weight_version == "step-1"


def test_weights_saved_in_another_dtype_are_converted_to_the_models(tmp_path, demo_model_dir, new_weights_dir):
    half = tmp_path / "bf16"
    shutil.copytree(new_weights_dir, half)
    tensors = load_file(half / "model.safetensors")
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, half / "model.safetensors",
              metadata={"format": "pt"})
    loaded = load_model(str(demo_model_dir), device="cpu")
    load_weights(loaded, half, weight_version="bf16")
    param = dict(loaded.model.named_parameters())["model.language_model.embed_tokens.weight"]
    assert param.dtype == torch.float32
    assert torch.equal(param, tensors["model.embed_tokens.weight"].to(torch.bfloat16).to(torch.float32))


def test_a_sharded_checkpoint_with_an_index_loads(tmp_path, demo_model_dir, new_weights_dir):
    sharded = tmp_path / "sharded"
    shutil.copytree(new_weights_dir, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({name: tensors[name] for name in part}, sharded / file, metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: file for file, part in shards.items() for name in part}}))
    loaded = load_model(str(demo_model_dir), device="cpu")
    load_weights(loaded, sharded, weight_version="sharded")
    fresh = load_model(str(new_weights_dir), device="cpu").model.state_dict()
    assert all(torch.equal(loaded.model.state_dict()[name], fresh[name]) for name in fresh)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _bad_missing(d):
    _edit_tensors(d, lambda t: t.pop("lm_head.weight"))


def _bad_extra(d):
    _edit_tensors(d, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2)}))


def _bad_shape(d):
    _edit_tensors(d, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1].clone()}))


def _bad_nan(d):
    def poison(tensors):
        tensors["model.norm.weight"][3] = float("nan")
    _edit_tensors(d, poison)


def _bad_pickle(d):
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()


def _bad_truncated(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _bad_config(d):
    config = json.loads((d / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 0.5
    (d / "config.json").write_text(json.dumps(config))


def _bad_no_config(d):
    (d / "config.json").unlink()


def _bad_index(d):
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))


@pytest.mark.parametrize(("spoil", "problem"), [
    (_bad_missing, "missing_tensor"), (_bad_extra, "unexpected_tensor"), (_bad_shape, "shape_mismatch"),
    (_bad_nan, "non_finite"), (_bad_pickle, "no_safetensors"), (_bad_truncated, "bad_file"),
    (_bad_config, "config_mismatch"), (_bad_no_config, "no_config"), (_bad_index, "bad_index"),
])
def test_a_bad_directory_is_a_typed_error_and_changes_nothing(tmp_path, untouched, new_weights_dir, spoil, problem):
    directory = _copy(new_weights_dir, tmp_path / "bad")
    spoil(directory)
    before, version = _snapshot(untouched), untouched.weight_version
    with pytest.raises(WeightsInvalidError) as caught:
        load_weights(untouched, directory, weight_version="never")
    assert caught.value.errors["problem"] == problem and caught.value.fault is Fault.INVALID
    assert untouched.weight_version == version
    after = untouched.model.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_another_architecture_is_refused(tmp_path, untouched):
    llava = build_demo_model(tmp_path / "llava", arch="llava")
    with pytest.raises(WeightsInvalidError) as caught:
        load_weights(untouched, llava, weight_version="never")
    assert caught.value.errors["problem"] == "architecture_mismatch"


def test_a_path_that_is_not_a_directory_is_refused(tmp_path, untouched):
    with pytest.raises(WeightsInvalidError) as caught:
        load_weights(untouched, tmp_path / "nothing-here", weight_version="never")
    assert caught.value.errors["problem"] == "not_a_directory"


def _root_with_copy(tmp_path, new_weights_dir):
    root = tmp_path / "root"
    shutil.copytree(new_weights_dir, root / "step-1")
    outside = tmp_path / "outside"
    shutil.copytree(new_weights_dir, outside)
    return root, outside


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_file_that_is_a_symlink_out_of_the_root_is_refused(tmp_path, untouched, new_weights_dir, name):
    root, outside = _root_with_copy(tmp_path, new_weights_dir)
    (root / "step-1" / name).unlink()
    (root / "step-1" / name).symlink_to(outside / name)
    before = _snapshot(untouched)
    with pytest.raises(WeightsInvalidError) as caught:
        load_weights(untouched, root / "step-1", weight_version="escaped", root=root)
    assert caught.value.problem == "not_a_regular_file" and caught.value.errors["file"] == name
    assert all(torch.equal(before[n], t) for n, t in untouched.model.state_dict().items())
    assert untouched.weight_version != "escaped"


def test_a_directory_swapped_for_a_symlink_after_its_check_is_refused(tmp_path, untouched, new_weights_dir):
    """The race a path check leaves open: checked, then swapped for a symlink out, then read."""
    from domain.weights.paths import resolve_weights_dir

    root, outside = _root_with_copy(tmp_path, new_weights_dir)
    checked = resolve_weights_dir("step-1", root)
    shutil.rmtree(root / "step-1")
    (root / "step-1").symlink_to(outside, target_is_directory=True)
    with pytest.raises(WeightsInvalidError) as caught:
        load_weights(untouched, checked, weight_version="escaped", root=root)
    assert caught.value.problem == "not_a_directory" and untouched.weight_version != "escaped"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_a_device_is_refused_at_once(tmp_path, untouched, new_weights_dir, kind):
    import os

    root, _ = _root_with_copy(tmp_path, new_weights_dir)
    target = root / "step-1" / "model.safetensors"
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)  # reading it would wait for a writer forever
    else:
        os.mknod(target, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    with pytest.raises(WeightsInvalidError) as caught:
        load_weights(untouched, root / "step-1", weight_version="device", root=root)
    assert caught.value.problem == "not_a_regular_file"


def test_a_confined_directory_in_the_root_still_loads(tmp_path, demo_model_dir, new_weights_dir):
    root, _ = _root_with_copy(tmp_path, new_weights_dir)
    loaded = load_model(str(demo_model_dir), device="cpu")
    swap = load_weights(loaded, root / "step-1", weight_version="step-1", root=root)
    assert swap.tensors > 0 and loaded.weight_version == "step-1"
