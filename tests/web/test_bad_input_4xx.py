"""Bad input is a 4xx with a code, never a 500 (issue #47 item 6): a render part whose ``type`` is
not a string, a token prompt holding a media placeholder id without media, an admin weights path
longer than a file name may be."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from tests.web.conftest import auth


@pytest.fixture
def model(client):
    return client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]


@pytest.mark.parametrize("kind", [["text"], {"type": "text"}, 7, None])
def test_a_render_part_whose_type_is_not_a_string_is_a_422(client, model, kind):
    messages = [{"role": "user", "content": [{"type": kind, "text": "hi"}]}]
    for path in ("/v1/chat/completions/render", "/v1/chat/completions"):
        reply = client.post(path, json={"model": model, "messages": messages, "max_tokens": 2}, headers=auth())
        assert reply.status_code == 422, (path, reply.status_code, reply.get_json())
        assert reply.get_json()["error"]["code"] == "invalid_request", reply.get_json()


def test_a_token_prompt_with_a_placeholder_id_and_no_media_is_refused_before_queueing(client, demo_model_dir, model):
    """A sampled ``<|image_pad|>`` sent back in an agent's next turn, with no image: the GPU worker's
    rope index would fail on it (a 500 there); the API refuses it at submit."""
    image_token = AutoConfig.from_pretrained(demo_model_dir).image_token_id
    for path, body in (("/v1/jobs", {"token_ids": [100, image_token, 101]}),
                       ("/v1/completions", {"model": model, "prompt": [100, image_token, 101], "max_tokens": 2}),
                       ("/inference/v1/generate", {"model": model, "token_ids": [100, image_token],
                                                   "sampling_params": {"max_tokens": 2}}),
                       ("/generate", {"input_ids": [100, image_token], "sampling_params": {"max_new_tokens": 2}})):
        reply = client.post(path, json=body, headers=auth())
        assert reply.status_code == 422, (path, reply.status_code, reply.get_json())
        assert "placeholder" in reply.get_data(as_text=True), (path, reply.get_json())


def test_an_admin_weights_path_longer_than_a_file_name_is_a_422(make_app, tmp_path):
    root = tmp_path / "weights"
    root.mkdir()
    client = make_app(admin_keys=("admin",), weights_root=root).test_client()
    for path in ("x" * 300, "step/" + "y" * 256, "/".join(["z" * 200] * 30)):
        reply = client.post("/v1/weights", json={"model_path": path, "weight_version": "v9"}, headers=auth("admin"))
        assert reply.status_code == 422, (reply.status_code, reply.get_json())


def test_vllm_features_this_service_never_rendered_name_the_cause(client, model):
    """What vLLM's own render returns (media by hash, ``kwargs_data: null``) holds nothing this
    service can run: a 422 that says so, not "invalid fields"."""
    features = {"mm_hashes": {"image": ["9f86d081884c7d65"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 4}]},
                "kwargs_data": None}
    reply = client.post("/inference/v1/generate", json={"model": model, "token_ids": [100, 101, 102, 103, 104, 105],
                                                        "features": features, "sampling_params": {"max_tokens": 2}},
                        headers=auth())
    assert reply.status_code == 422, reply.get_json()
    error = reply.get_json()["error"]  # the vLLM route answers in OpenAI's error shape
    assert error["code"] == "features_not_rendered_here" and error["param"] == "features", error
    assert "render" in error["message"]
