"""Video and audio through the whole stack on the model `rollout-queue up` serves when none is
configured (the tiny Qwen2.5-Omni thinker, built by the workers themselves in the state dir):
a video job, an audio job, one with an image, a video and an audio, the cache, /v1/render, and
media that must fail with a clear code."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import empty_db_url
from tests.e2e.conftest import build_stack, log_dir_for, make_stack_env
from tests.media_files import mp4_bytes, png_bytes, wav_bytes


@pytest.fixture(scope="module")
def media_stack(redis_url, loopback_host, tmp_path_factory):
    env = make_stack_env(redis_url=empty_db_url(redis_url, 15), model_dir="", state_dir=tmp_path_factory.mktemp("media"),
                         loopback=loopback_host, ROLLOUT_MAX_VIDEO_SECONDS="5")
    del env["ROLLOUT_MODEL"]  # as `rollout-queue up` with no model configured: the built-in demo
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "media-logs"), workers=("cpu", "gpu"),
                     timeout=180) as stack:
        yield stack


@pytest.fixture(scope="module")
def media(loopback_host):
    host = loopback_host
    one_hertz = io.BytesIO()
    sf.write(one_hertz, np.zeros(4, np.float32), 1, format="WAV")
    clip = mp4_bytes(frames=4, seed=7)
    return {
        "image": host.route("/m/cat.png", (200, {"Content-Type": "image/png"}, png_bytes(64, 48))),
        "video": host.route("/m/clip.mp4", (200, {"Content-Type": "video/mp4"}, clip)),
        "audio": host.route("/m/voice.wav", (200, {"Content-Type": "audio/wav"}, wav_bytes(1.0, rate=44_100))),
        "long_video": host.route("/m/long.mp4", (200, {}, mp4_bytes(frames=14, rate=2))),  # 7 s > 5 s
        "truncated_video": host.route("/m/cut.mp4", (200, {}, clip[: len(clip) // 3])),
        "image_as_video": host.route("/m/not-a-video.mp4", (200, {"Content-Type": "video/mp4"}, png_bytes(8, 8))),
        "one_hertz": host.route("/m/1hz.wav", (200, {}, one_hertz.getvalue())),
    }


def run(stack, prompt, parts, **sampling):
    job = stack.submit({"prompt": prompt, "content_parts": parts,
                        "sampling_params": {"max_tokens": 4, "temperature": 0, **sampling}})
    return stack.wait(job["id"], timeout=120)


def assert_generated(job, modalities):
    assert job["status"] == "succeeded", job["error"]
    result = job["result"]
    assert [r["modality"] for r in result["placeholder_ranges"]] == modalities
    (choice,) = result["choices"]
    assert len(choice["token_ids"]) == 4 and len(choice["logprobs"]) == 4
    assert all(lp <= 0 for lp in choice["logprobs"])
    return result


def test_the_served_demo_takes_video_audio_and_all_three_at_once(media_stack, media):
    video = assert_generated(run(media_stack, "What happens in <video>?", [{"type": "video_url", "url": media["video"]}]),
                             ["video"])
    assert video["placeholder_ranges"][0]["length"] == 8  # 4 frames of 64x48: 2 x 4 x 4 patches / 4

    audio = assert_generated(run(media_stack, "<audio> Who speaks?", [{"type": "audio_url", "url": media["audio"]}]),
                             ["audio"])
    assert audio["placeholder_ranges"][0]["length"] == 25  # 1 s, resampled from 44.1 kHz

    parts = [{"type": "image_url", "url": media["image"]}, {"type": "video_url", "url": media["video"]},
             {"type": "audio_url", "url": media["audio"]}]
    together = assert_generated(run(media_stack, "<image> <video> <audio> Describe all three.", parts),
                                ["image", "video", "audio"])
    assert [r["length"] for r in together["placeholder_ranges"]] == [4, 8, 25]
    ids = together["prompt_token_ids"]
    for r in together["placeholder_ranges"]:
        assert len(set(ids[r["offset"]:r["offset"] + r["length"]])) == 1


def test_the_same_video_twice_hits_the_cache(media_stack, media, loopback_host):
    counters = "rq:metrics:counters"
    before = int(media_stack.services.redis.hget(counters, "mm_cache_hit") or 0)
    part = {"type": "video_url", "url": media["video"]}
    first = run(media_stack, "<video>", [part])
    second = run(media_stack, "<video>", [part])
    assert second["status"] == first["status"] == "succeeded"
    assert second["result"]["prompt_token_ids"] == first["result"]["prompt_token_ids"]
    assert second["result"]["choices"][0]["token_ids"] == first["result"]["choices"][0]["token_ids"]
    assert second["result"]["timings"]["decode"] == second["result"]["timings"]["process"] == 0
    assert int(media_stack.services.redis.hget(counters, "mm_cache_hit")) >= before + 1

    # By uuid, the second job does not even fetch the video.
    named = {**part, "uuid": "clip-e2e"}
    fetched = len(loopback_host.requests["/m/clip.mp4"])
    assert run(media_stack, "<video>", [named])["status"] == "succeeded"
    assert run(media_stack, "<video>", [named])["status"] == "succeeded"
    assert len(loopback_host.requests["/m/clip.mp4"]) == fetched + 1


@pytest.mark.parametrize(("name", "kind", "code"), [
    ("long_video", "video_url", "media_too_large"),
    ("truncated_video", "video_url", "media_decode_failed"),
    ("image_as_video", "video_url", "media_decode_failed"),
    ("one_hertz", "audio_url", "media_decode_failed"),
    ("video", "audio_url", "media_decode_failed"),  # a video sent as audio
])
def test_bad_media_fails_the_job_with_a_clear_code(media_stack, media, name, kind, code):
    marker = "<video>" if kind == "video_url" else "<audio>"
    job = run(media_stack, marker, [{"type": kind, "url": media[name]}])
    assert job["status"] == "failed"
    assert job["error"]["code"] == code
    assert job["error"]["message"].startswith("content_parts[0]: ")


def test_render_then_generate_with_video_and_input_audio(media_stack, media):
    wav = base64.b64encode(wav_bytes(0.5)).decode()
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": media["video"]}},
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        {"type": "text", "text": "What do you see and hear?"}]}]
    response = media_stack.client.post("/v1/render", json={"messages": messages}, headers=media_stack.headers())
    assert response.status_code == 200, response.get_json()
    rendered = response.get_json()
    assert [p["type"] for p in rendered["content_parts"]] == ["video_url", "audio_url"]
    job = media_stack.submit({"token_ids": rendered["token_ids"], "content_parts": rendered["content_parts"],
                              "sampling_params": {"max_tokens": 4, "temperature": 0}})
    done = media_stack.wait(job["id"], timeout=120)
    assert done["status"] == "succeeded", done["error"]
    assert done["result"]["prompt_token_ids"] == rendered["token_ids"]
    assert [r["length"] for r in done["result"]["placeholder_ranges"]] == [8, 12]  # 0.5 s: 12 audio tokens
