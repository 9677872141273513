"""The model probe (domain/model_probe.py): a child process finds what the API needs of the model,
the same as transformers finds in place, and the answer is cached by the model's config files."""

from __future__ import annotations

import json
import shutil

import pytest

from domain.model_probe import _cache_file, _probe_in_child, probe, probe_here
from engine.errors import ModelLoadError


def test_the_child_finds_what_is_found_in_place(demo_model_dir):
    assert _probe_in_child(str(demo_model_dir)) == probe_here(str(demo_model_dir))


def test_a_process_holding_torch_probes_in_place_and_caches_nothing(demo_model_dir, tmp_path):
    assert probe(str(demo_model_dir), cache_dir=tmp_path) == probe_here(str(demo_model_dir))
    assert not list(tmp_path.iterdir())


def test_the_cache_is_keyed_by_the_models_config(demo_model_dir, tmp_path):
    model = shutil.copytree(demo_model_dir, tmp_path / "model")
    before = _cache_file(str(model), tmp_path / "cache")
    assert _cache_file(str(model), tmp_path / "cache") == before
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": config.get("vocab_size", 0) + 1}))
    assert _cache_file(str(model), tmp_path / "cache") != before
    assert _cache_file("org/hub-model", tmp_path / "cache") is None  # nothing local to key by


def test_a_model_the_child_cannot_read_is_a_model_load_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        _probe_in_child(str(tmp_path))


def test_a_cached_probe_of_an_older_build_is_probed_again(demo_model_dir, tmp_path):
    from transformers import AutoConfig

    from domain.model_probe import _from_json, _to_json

    found = probe_here(str(demo_model_dir))
    assert found.facts.placeholder_token_ids == {AutoConfig.from_pretrained(demo_model_dir).image_token_id,
                                                 AutoConfig.from_pretrained(demo_model_dir).video_token_id}
    assert _from_json(json.loads(json.dumps(_to_json(found)))) == found
    older = _to_json(found)
    del older["facts"]["placeholder_token_ids"]  # written before the field existed
    with pytest.raises(KeyError):
        _from_json(older)
    renamed = _to_json(found)
    renamed["facts"]["context_length"] = renamed["facts"].pop("context_tokens")  # the context's name before #60
    with pytest.raises(KeyError):
        _from_json(renamed)
