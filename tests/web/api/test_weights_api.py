"""The weight-update routes without GPU workers: who may call them, which paths they take, and
that a refused call leaves the fleet's target as it was."""

from __future__ import annotations

import os

import pytest

from domain.weights.store import WeightStore
from engine.demo_model import build_demo_model
from tests.web.conftest import KEY_A, auth

ADMIN = "admin-key-secret"


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights-root")
    build_demo_model(root / "step-1", seed=1)
    return root


@pytest.fixture
def admin_client(make_app, weights_root):
    return make_app(admin_keys=(ADMIN,), weights_root=weights_root, weights_update_timeout=2.0).test_client()


def _post(client, body, key=ADMIN, path="/v1/weights"):
    return client.post(path, json=body, headers=auth(key))


def test_a_non_admin_key_gets_403_on_every_weight_route(admin_client, weights_root):
    body = {"model_path": str(weights_root / "step-1"), "weight_version": "v1"}
    for path, payload in (("/v1/weights", body), ("/update_weights_from_disk", body), ("/pause_generation", {}),
                          ("/continue_generation", None)):
        response = admin_client.post(path, json=payload, headers=auth(KEY_A))
        assert response.status_code == 403 and response.get_json()["code"] == "forbidden", path
    assert admin_client.get("/v1/weights", headers=auth(KEY_A)).status_code == 403
    assert admin_client.post("/v1/weights", json=body).status_code == 401


def test_an_admin_key_is_an_api_key_too(admin_client):
    assert admin_client.get("/v1/jobs", headers=auth(ADMIN)).status_code == 200


def test_with_api_keys_but_no_admin_keys_nobody_may(make_app, weights_root):
    client = make_app(weights_root=weights_root).test_client()
    assert client.get("/v1/weights", headers=auth(KEY_A)).status_code == 403


def test_the_open_demo_lets_anyone_and_says_so(make_app, weights_root, caplog):
    with caplog.at_level("WARNING"):
        client = make_app(api_keys=(), weights_root=weights_root).test_client()
    assert any("update the weights" in r.getMessage() for r in caplog.records)
    assert client.get("/v1/weights").status_code == 200


def test_without_a_weights_root_updates_are_off(make_app, weights_root):
    client = make_app(admin_keys=(ADMIN,)).test_client()
    response = _post(client, {"model_path": str(weights_root / "step-1"), "weight_version": "v1"})
    assert response.status_code == 409 and response.get_json()["code"] == "weight_updates_disabled"


def _escapes(root, tmp_path, demo_model_dir):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(demo_model_dir, root / "link-out")
    return [str(demo_model_dir), f"{root}/../{os.path.basename(demo_model_dir)}", "step-1/../../x", "link-out",
            str(root / "link-out"), "/etc", "", "step-1\x00"]


def test_paths_that_leave_the_root_are_refused_and_nothing_changes(admin_client, weights_root, tmp_path,
                                                                   demo_model_dir, redis_client):
    try:
        for path in _escapes(weights_root, tmp_path, demo_model_dir):
            response = _post(admin_client, {"model_path": path, "weight_version": "v1"})
            assert response.status_code == 422, path
            assert response.get_json()["code"] in ("weights_path_refused", "invalid_request"), path
    finally:
        os.unlink(weights_root / "link-out")
    assert WeightStore(redis_client).target() is None


def test_a_bad_directory_is_a_422_naming_the_problem_and_changes_nothing(admin_client, weights_root, redis_client):
    bad = weights_root / "bad-shapes"
    build_demo_model(bad, arch="qwen2_5_vl")
    response = _post(admin_client, {"model_path": "bad-shapes", "weight_version": "v1"})
    assert response.status_code == 422
    body = response.get_json()
    assert body["code"] == "weights_invalid" and body["errors"]["problem"] in ("architecture_mismatch",
                                                                              "config_mismatch")
    (weights_root / "empty").mkdir(exist_ok=True)
    response = _post(admin_client, {"model_path": "empty", "weight_version": "v1"})
    assert response.status_code == 422 and response.get_json()["errors"]["problem"] == "no_config"
    assert WeightStore(redis_client).target() is None


def test_an_update_with_no_live_gpu_worker_sets_the_target_for_later_workers(admin_client, weights_root):
    response = _post(admin_client, {"model_path": "step-1", "weight_version": "step-1", "mode": "retract"})
    assert response.status_code == 200, response.get_json()
    body = response.get_json()
    assert body["success"] and body["workers"] == [] and body["weight_version"] == "step-1"
    state = admin_client.get("/v1/weights", headers=auth(ADMIN)).get_json()
    assert state["target"]["version"] == "step-1" and state["target"]["mode"] == "retract"
    assert state["target"]["model_path"] == str((weights_root / "step-1").resolve())
    assert state["target"]["recompute_kv"] is False


def test_mode_keep_takes_recompute_kv(admin_client, weights_root):
    body = {"model_path": "step-1", "weight_version": "step-k", "mode": "keep", "recompute_kv": True}
    assert _post(admin_client, body).status_code == 200
    target = admin_client.get("/v1/weights", headers=auth(ADMIN)).get_json()["target"]
    assert target["mode"] == "keep" and target["recompute_kv"] is True
    assert _post(admin_client, {**body, "recompute_kv": "yes"}).status_code == 422
    # Outside mode keep it would change nothing: refused by name, not ignored.
    ignored = _post(admin_client, {**body, "mode": "finish"})
    assert ignored.status_code == 422 and "recompute_kv" in ignored.get_json()["errors"]


def test_sglang_routes_take_sglang_bodies(admin_client, weights_root):
    response = _post(admin_client, {"model_path": "step-1", "abort_all_requests": True, "flush_cache": True,
                                    "load_format": None}, path="/update_weights_from_disk")
    assert response.status_code == 200, response.get_json()
    assert response.get_json() == {"success": True, "num_paused_requests": 0,
                                   "message": response.get_json()["message"]}
    state = admin_client.get("/v1/weights", headers=auth(ADMIN)).get_json()
    assert state["target"]["mode"] == "abort" and len(state["target"]["version"]) == 16  # content hash
    assert _post(admin_client, {"mode": "retract"}, path="/pause_generation").get_json()["success"]
    assert admin_client.get("/v1/weights", headers=auth(ADMIN)).get_json()["paused"] == "retract"
    assert _post(admin_client, None, path="/continue_generation").get_json()["success"]
    assert admin_client.get("/v1/weights", headers=auth(ADMIN)).get_json()["paused"] is None
    assert _post(admin_client, {"mode": "sideways"}, path="/pause_generation").status_code == 422


def test_vllm_pause_and_resume_take_vllms_query_and_answer_its_shape(admin_client):
    forbidden = admin_client.post("/pause", headers=auth(KEY_A))
    assert forbidden.status_code == 403 and forbidden.get_json()["error"]["code"] == "forbidden"  # OpenAI's shape
    for query, ours in (("?mode=keep", "keep"), ("?mode=wait", "finish"), ("", "abort"),
                        ("?mode=abort&wait_for_inflight_requests=true", "finish")):
        response = admin_client.post(f"/pause{query}", headers=auth(ADMIN))
        assert response.status_code == 200 and response.get_json() == {"status": "paused"}, query
        assert admin_client.get("/v1/weights", headers=auth(ADMIN)).get_json()["paused"] == ours, query
        assert admin_client.get("/is_paused", headers=auth(KEY_A)).get_json() == {"is_paused": True}
    assert admin_client.post("/resume", headers=auth(ADMIN)).get_json() == {"status": "resumed"}
    assert admin_client.get("/is_paused", headers=auth(KEY_A)).get_json() == {"is_paused": False}
    assert admin_client.post("/pause?mode=sideways", headers=auth(ADMIN)).status_code == 422
    assert admin_client.post("/resume", headers=auth(KEY_A)).status_code == 403


@pytest.mark.timeout(30)
def test_a_symlinked_or_special_weight_file_is_refused_before_any_target(make_app, tmp_path, redis_client):
    """The API's own check reads through the confined directory too: a config.json symlinked out of
    the root, or a FIFO as the weights (which hung the admin call), is a 422 and sets no target."""
    import shutil

    root = tmp_path / "root"
    build_demo_model(root / "step-1", seed=1)
    shutil.copytree(root / "step-1", root / "fifo")
    (root / "step-1" / "config.json").rename(tmp_path / "outside-config.json")
    (root / "step-1" / "config.json").symlink_to(tmp_path / "outside-config.json")
    (root / "fifo" / "model.safetensors").unlink()
    os.mkfifo(root / "fifo" / "model.safetensors")
    client = make_app(admin_keys=(ADMIN,), weights_root=root, weights_update_timeout=2.0).test_client()
    for name in ("step-1", "fifo"):
        response = _post(client, {"model_path": name, "weight_version": name})
        assert response.status_code == 422, response.get_json()
        assert response.get_json()["errors"]["problem"] == "not_a_regular_file", response.get_json()
    assert WeightStore(redis_client).target() is None
