"""Media references in dialect bodies: raw base64 goes through the guarded fetcher as a data: URL."""

from __future__ import annotations

import base64

import pytest
import torch

from engine.errors import InvalidRequestError


def test_raw_base64_obeys_the_data_url_cap():
    from engine.errors import MediaError
    from processors.fetch import FetchPolicy, GuardedFetcher
    from web.dialects.common import media_url

    assert media_url("https://example.com/a.png", "image_data") == "https://example.com/a.png"
    fetcher = GuardedFetcher(FetchPolicy(max_bytes=1024))
    assert fetcher.fetch(media_url(base64.b64encode(b"x" * 1000).decode(), "image_data")).data == b"x" * 1000
    with pytest.raises(MediaError) as too_large:
        fetcher.fetch(media_url(base64.b64encode(b"x" * 2000).decode(), "image_data"))
    assert too_large.value.code == "media_too_large"


def test_a_file_name_is_not_read():
    from web.dialects.common import media_url

    with pytest.raises(InvalidRequestError) as refused:
        media_url("../secrets/cat.png", "image_data[0]")
    assert "image_data[0]" in refused.value.message


def test_openapi_lists_every_dialect_route(client):
    paths = set(client.get("/openapi.json").get_json()["paths"])
    assert {"/generate", "/health", "/health_generate", "/get_model_info", "/get_server_info", "/flush_cache",
            "/abort_request", "/inference/v1/generate", "/v1/chat/completions/render", "/v1/completions/render",
            "/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
            "/v1/generate"} <= paths


def test_sglang_media_fields_become_content_parts_per_modality():
    from web.dialects.sglang.request import to_requests

    body = {"text": "<video><image><audio>", "image_data": ["https://e.com/a.png"],
            "video_data": "https://e.com/v.mp4", "audio_data": ["https://e.com/1.wav", "https://e.com/2.wav"]}
    (request,), _, batch = to_requests(body, vocab_size=None)
    assert not batch
    assert request["content_parts"] == [
        {"type": "image_url", "url": "https://e.com/a.png"}, {"type": "video_url", "url": "https://e.com/v.mp4"},
        {"type": "audio_url", "url": "https://e.com/1.wav"}, {"type": "audio_url", "url": "https://e.com/2.wav"}]


def test_flush_cache_is_for_admin_keys_only(make_app):
    """The cache holds every key's entries (uuid entries are their owner's): one key flushing it
    would make another's uuid-only requests fail, so only admins may."""
    from tests.web.conftest import KEY_A, KEY_B, auth

    client = make_app(admin_keys=(KEY_A,)).test_client()
    cache = client.application.extensions["rollout"].mm_cache
    key = cache.key(model_id="m", modality="image", options={}, uuid="img-1", owner="someone")
    cache.put(key, {"pixel_values": torch.ones(2, 2)}, "hash")
    refused = client.post("/flush_cache", headers=auth(KEY_B))
    assert refused.status_code == 403 and len(cache) == 1
    assert client.post("/flush_cache", headers=auth(KEY_A)).status_code == 200 and len(cache) == 0


def test_a_single_sglang_prompt_takes_a_list_of_one_and_refuses_longer_lists():
    """A one-element list of sampling_params or return_logprob for one prompt is its value (it was
    dropped: asked 1 token, got 64); a list logprob_start_len was a 500; more values are a 422."""
    from web.dialects.sglang.request import to_requests

    body = {"input_ids": [5, 6, 7], "sampling_params": [{"max_new_tokens": 1}], "return_logprob": [True],
            "logprob_start_len": [1]}
    (request,), (options,), batch = to_requests(body, vocab_size=None)
    assert not batch and request["sampling_params"]["max_tokens"] == 1
    assert request["sampling_params"]["logprobs"] is True and options["logprob_start_len"] == 1
    (request,), _, _ = to_requests({**body, "return_logprob": [False]}, vocab_size=None)
    assert request["sampling_params"]["logprobs"] is False
    for name, value in (("logprob_start_len", [1, 2]), ("sampling_params", [{}, {}])):
        with pytest.raises(InvalidRequestError) as caught:
            to_requests({**body, name: value}, vocab_size=None)
        assert name in caught.value.errors
