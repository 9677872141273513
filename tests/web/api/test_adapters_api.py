"""The adapter routes' refusals and listings (#58 items 1-3), API only (no GPU worker: a load
answers at once, each worker loading the set when it starts). The whole path with workers:
tests/e2e/test_lora_e2e.py."""

from __future__ import annotations

import json

from tests.web.conftest import KEY_A, KEY_B, auth


def adapter_dir(directory, **config):
    """A directory the API's checks pass or refuse by its config alone (the weights are the GPU
    workers' to check against the base; none runs here)."""
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 8, **config}))
    (directory / "adapter_model.safetensors").write_bytes(b"")
    return directory


def test_adapter_routes_refuse_in_each_dialects_shape(make_app, tmp_path):
    off = make_app().test_client()
    assert off.get("/v1/adapters").status_code == 401
    disabled = off.post("/v1/adapters", json={"name": "x", "path": "x"}, headers=auth())
    assert disabled.status_code == 409 and disabled.get_json()["code"] == "weight_updates_disabled"

    root = tmp_path / "root"
    adapter_dir(root / "tuned", r=4)
    adapter_dir(root / "wide", r=128)
    adapter_dir(root / "dora", r=4, use_dora=True)
    (root / "empty").mkdir()
    client = make_app(weights_root=root, max_loras_per_key=1).test_client()
    for path, problem in (("wide", "rank_too_large"), ("dora", "unsupported"), ("empty", "missing_file")):
        refused = client.post("/v1/adapters", json={"name": "x", "path": path}, headers=auth())
        assert refused.status_code == 422 and refused.get_json()["errors"]["problem"] == problem, refused.get_json()
    assert client.get("/v1/adapters", headers=auth()).get_json()["data"] == [], "nothing changed"
    outside = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}, headers=auth())
    assert outside.status_code == 422 and outside.get_json()["error"]["code"] == "weights_path_refused"
    bad_name = client.post("/v1/adapters", json={"name": "a b", "path": "tuned"}, headers=auth())
    assert bad_name.status_code == 422
    missing = client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=auth())
    assert missing.status_code == 404 and missing.get_json()["error"]["code"] == "adapter_not_found"
    sglang_missing = client.post("/unload_lora_adapter", json={"lora_name": "x"}, headers=auth())
    assert sglang_missing.status_code == 404 and sglang_missing.get_json()["error"]["code"] == "adapter_not_found"

    loaded = client.post("/v1/adapters", json={"name": "tuned", "path": "tuned"}, headers=auth())
    assert loaded.status_code == 200 and loaded.get_json()["shared"] is False
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": "tuned"}, headers=auth())
    assert again.status_code == 409 and again.get_json()["error"]["code"] == "adapter_exists"
    capped = client.post("/v1/adapters", json={"name": "more", "path": "tuned"}, headers=auth())
    assert capped.status_code == 409 and capped.get_json()["code"] == "adapter_limit_reached"
    newer = client.post("/v1/adapters", json={"name": "tuned", "path": "tuned", "load_inplace": True,
                                              "mode": "abort"}, headers=auth())
    assert newer.status_code == 200 and newer.get_json()["version"] > loaded.get_json()["version"]
    kept = client.post("/v1/adapters", json={"name": "tuned", "path": "tuned", "load_inplace": True, "mode": "keep",
                                             "recompute_kv": True}, headers=auth())
    assert kept.status_code == 200 and kept.get_json()["version"] > newer.get_json()["version"]
    assert (kept.get_json()["mode"], kept.get_json()["recompute_kv"]) == ("keep", True)
    odd = client.post("/v1/adapters", json={"name": "tuned", "path": "tuned", "load_inplace": True, "mode": "wait"},
                      headers=auth())
    assert odd.status_code == 422 and odd.get_json()["code"] == "invalid_request"
    ignored = client.post("/v1/adapters", json={"name": "tuned", "path": "tuned", "load_inplace": True,
                                                "recompute_kv": True}, headers=auth())
    assert ignored.status_code == 422 and "recompute_kv" in ignored.get_json()["errors"]

    assert [a["name"] for a in client.get("/v1/adapters", headers=auth(KEY_A)).get_json()["data"]] == ["tuned"]
    assert client.get("/v1/adapters", headers=auth(KEY_B)).get_json()["data"] == []
    assert client.get("/v1/adapters/tuned", headers=auth(KEY_B)).status_code == 404
    unknown = client.post("/v1/generate", json={"token_ids": [1, 2], "adapter": "tuned"}, headers=auth(KEY_B))
    assert unknown.status_code == 404 and unknown.get_json()["code"] == "adapter_not_found"
    models = client.get("/v1/models", headers=auth(KEY_B)).get_json()["data"]
    assert len(models) == 1, "another key's adapter is not listed"
    sglang = client.post("/generate", json={"input_ids": [1, 2], "lora_path": "tuned"}, headers=auth(KEY_B))
    assert sglang.status_code == 404 and sglang.get_json()["error"]["code"] == "adapter_not_found"
    assert client.delete("/v1/adapters/tuned", headers=auth(KEY_B)).status_code == 404
    assert client.delete("/v1/adapters/tuned", headers=auth(KEY_A)).status_code == 200
