"""Decoders: allowed formats come back as RGB pixels, sampled frames or mono samples; caps,
lying or broken files are typed errors (media_too_large, media_decode_failed), never a hang."""

from __future__ import annotations

import io
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image, ImageFile

from engine.errors import InternalError
from processors.decode import VideoSampling, decode_audio, decode_image, decode_video
from processors.fetch import MediaDecodeError, MediaTooLargeError


def png_bytes(size: tuple[int, int] = (64, 48), fmt: str = "PNG", noise: bool = False) -> bytes:
    img = Image.effect_noise(size, 64).convert("RGB") if noise else Image.new("RGB", size, (200, 30, 90))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


# ---------------------------------------------------------------- images


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_allowed_image_formats_decode_to_rgb(fmt) -> None:
    img = decode_image(png_bytes(fmt=fmt), max_pixels=64 * 48)
    assert img.mode == "RGB" and img.size == (64, 48)
    assert np.asarray(img).shape == (48, 64, 3)


def test_format_outside_the_allowlist() -> None:
    with pytest.raises(MediaDecodeError):
        decode_image(png_bytes(fmt="TIFF"), max_pixels=10_000)
    with pytest.raises(MediaDecodeError):
        decode_image(png_bytes(fmt="JPEG"), max_pixels=10_000, formats=("PNG",))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_images_are_errors(fmt) -> None:
    data = png_bytes((256, 256), fmt=fmt, noise=True)
    assert not ImageFile.LOAD_TRUNCATED_IMAGES
    with pytest.raises(MediaDecodeError):
        decode_image(data[: len(data) * 2 // 3], max_pixels=10**6)


def test_garbage_is_a_decode_error() -> None:
    with pytest.raises(MediaDecodeError):
        decode_image(b"not an image at all", max_pixels=10**6)


def _png_declaring(width: int, height: int, real: bytes) -> bytes:
    """The real PNG with its IHDR rewritten to claim another size (CRC fixed up)."""
    ihdr_data = struct.pack(">II", width, height) + real[24:29]
    chunk = b"IHDR" + ihdr_data
    return real[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + real[33:]


def test_pixel_cap_is_checked_from_the_header() -> None:
    with pytest.raises(MediaTooLargeError):
        decode_image(_png_declaring(50_000, 50_000, png_bytes()), max_pixels=10**6)
    with pytest.raises(MediaTooLargeError):
        decode_image(png_bytes(), max_pixels=100)


def test_pillow_bomb_guard_is_an_error_too() -> None:
    # Our cap set above Pillow's: Pillow's own DecompressionBombError/Warning must still be errors.
    for side in (int((Image.MAX_IMAGE_PIXELS * 1.5) ** 0.5), int((Image.MAX_IMAGE_PIXELS * 3) ** 0.5)):
        with pytest.raises(MediaTooLargeError):
            decode_image(_png_declaring(side, side, png_bytes()), max_pixels=10**12)


def test_truncated_images_switched_on_elsewhere_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(InternalError):
        decode_image(png_bytes(), max_pixels=10**6)


# ---------------------------------------------------------------- video


def make_video(fmt: str = "mp4", codec: str = "mpeg4", frames: int = 6, rate: int = 5,
               size: tuple[int, int] = (64, 48)) -> bytes:
    """Frame i is a flat grey of value i * 40 (mod 256), so tests can tell which frames came back."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            pixels = np.full((size[1], size[0], 3), (i * 40) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return make_video("mp4", "mpeg4")


@pytest.fixture(scope="module")
def webm() -> bytes:
    return make_video("webm", "libvpx")


def grey_levels(video) -> list[int]:
    return [round(float(frame.mean()) / 40) for frame in video.frames]


@pytest.mark.parametrize("name", ["mp4", "webm"])
def test_video_frames_are_sampled_by_decoding(request, name) -> None:
    data = request.getfixturevalue(name)  # 6 frames at 5 fps: t = 0, 0.2, ..., 1.0
    every = decode_video(data, VideoSampling(fps=5.0))
    assert every.frames.shape == (6, 48, 64, 3) and every.frames.dtype == np.uint8
    assert grey_levels(every) == [0, 1, 2, 3, 4, 5] and every.fps == pytest.approx(5.0)
    sampled = decode_video(data, VideoSampling(fps=2.5))  # one frame per 0.4 s
    assert grey_levels(sampled) == [0, 2, 4] and sampled.fps == pytest.approx(2.5)
    assert sampled.duration == pytest.approx(0.8)


def test_a_source_slower_than_the_target_rate_reports_its_own_rate(mp4) -> None:
    video = decode_video(mp4, VideoSampling(fps=30.0))
    assert len(video.frames) == 6 and video.fps == pytest.approx(5.0)


def test_most_frames_spread_over_the_whole_video(mp4) -> None:
    # 1.2 s declared, 3 frames at most: the rate drops to 2.5 fps instead of keeping the start.
    video = decode_video(mp4, VideoSampling(fps=5.0, max_frames=3))
    assert grey_levels(video) == [0, 2, 4] and video.fps == pytest.approx(2.5)


@pytest.mark.parametrize("name", ["mp4", "webm"])
def test_video_caps(request, name) -> None:
    data = request.getfixturevalue(name)
    with pytest.raises(MediaTooLargeError, match="longer than 0.5 s"):
        decode_video(data, VideoSampling(max_seconds=0.5))
    with pytest.raises(MediaTooLargeError, match="more than 1000 pixels"):
        decode_video(data, VideoSampling(max_pixels=1000))


def test_far_more_frames_than_the_duration_allows_stops_at_the_frame_budget() -> None:
    # 600 frames in 0.6 s (1000 fps): past max_seconds * 240 decoded frames the decoder gives up.
    crowded = make_video(frames=600, rate=1000, size=(16, 16))
    with pytest.raises(MediaTooLargeError, match="more frames than 1.0 s at 240 fps"):
        decode_video(crowded, VideoSampling(max_seconds=1.0))
    spread = decode_video(crowded, VideoSampling(max_seconds=3.0, max_frames=4, fps=100.0))
    assert len(spread.frames) == 4 and spread.fps == pytest.approx(4 / 0.6, rel=0.01)


def test_broken_lying_and_empty_videos_are_decode_errors(mp4) -> None:
    cases = {
        "garbage": b"\x00" * 1000,
        "truncated": mp4[: len(mp4) // 3],
        "an image": png_bytes(),
        "audio only": _wav(0.5),
        "no frames": make_video(frames=0),
    }
    for what, data in cases.items():
        with pytest.raises(MediaDecodeError):
            decode_video(data, VideoSampling())
            pytest.fail(f"{what} decoded")


class _CountingHandler(BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).hits += 1
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_video_containers_cannot_open_other_files_or_urls(mp4, tmp_path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CountingHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    (tmp_path / "inner.mp4").write_bytes(mp4)
    scripts = [
        f"ffconcat version 1.0\nfile '{tmp_path / 'inner.mp4'}'\n",
        f"ffconcat version 1.0\nfile 'http://127.0.0.1:{port}/inner.mp4'\n",
        f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nhttp://127.0.0.1:{port}/seg.ts\n#EXT-X-ENDLIST\n",
    ]
    try:
        for script in scripts:
            with pytest.raises(MediaDecodeError):
                decode_video(script.encode(), VideoSampling())
    finally:
        server.shutdown()
    assert _CountingHandler.hits == 0


# ---------------------------------------------------------------- audio


def _wav(seconds: float, rate: int = 16_000, fmt: str = "WAV") -> bytes:
    """Stereo: a 440 Hz sine on the left, a constant 0.25 on the right."""
    t = np.arange(int(seconds * rate)) / rate
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    samples = np.stack([left, np.full_like(left, 0.25)], axis=1)
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG"])
def test_audio_decodes_to_mono_float32(fmt) -> None:
    audio = decode_audio(_wav(1.0, fmt=fmt), max_seconds=2.0)
    assert audio.sample_rate == 16_000 and audio.samples.dtype == np.float32 and audio.samples.shape == (16_000,)
    assert abs(float(audio.samples.mean()) - 0.125) < 0.01  # (sine + 0.25) / 2 averages to 0.125


def test_audio_is_resampled_to_the_rate_asked_for() -> None:
    audio = decode_audio(_wav(1.0, rate=44_100), max_seconds=2.0, sample_rate=16_000)
    assert audio.sample_rate == 16_000 and abs(len(audio.samples) - 16_000) <= 64
    assert audio.seconds == pytest.approx(1.0, abs=0.01)
    spectrum = np.abs(np.fft.rfft(audio.samples[:16_000] - audio.samples[:16_000].mean()))
    assert abs(int(spectrum.argmax()) - 440) <= 1  # still a 440 Hz tone


def test_audio_duration_cap() -> None:
    with pytest.raises(MediaTooLargeError):
        decode_audio(_wav(1.0), max_seconds=0.5)


def test_broken_lying_and_implausible_audio_are_decode_errors(mp4) -> None:
    cases = {
        "garbage": b"RIFF\x00\x00garbage",
        "truncated": _wav(1.0, fmt="FLAC")[:40],
        "an image": png_bytes(),
        "a video": mp4,
        "1 Hz": _wav(5.0, rate=1),
        "no samples": _wav(0.0),
    }
    for what, data in cases.items():
        with pytest.raises(MediaDecodeError):
            decode_audio(data, max_seconds=30.0, sample_rate=16_000)
            pytest.fail(f"{what} decoded")
