"""The adapter routes' refusals and listings (#58 items 1-3), API only (no GPU worker: a load
answers at once, each worker loading the set when it starts). The whole path with workers:
tests/e2e/test_lora_e2e.py."""

from __future__ import annotations

from tests.web.conftest import KEY_A, KEY_B, auth


def test_adapter_routes_refuse_in_each_dialects_shape(make_app, tmp_path):
    off = make_app().test_client()
    assert off.get("/v1/adapters").status_code == 401
    disabled = off.post("/v1/adapters", json={"name": "x", "path": "x"}, headers=auth())
    assert disabled.status_code == 409 and disabled.get_json()["code"] == "weight_updates_disabled"

    (tmp_path / "root" / "tuned").mkdir(parents=True)
    client = make_app(weights_root=tmp_path / "root", max_loras_per_key=1).test_client()
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
