"""Decoders: allowed formats come back as RGB pixels, frames or mono samples; caps are errors."""

from __future__ import annotations

import io
import struct
import zlib

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image, ImageFile

from engine.errors import InternalError
from processors.fetch import (
    MediaDecodeError,
    MediaTooLargeError,
    decode_audio,
    decode_image,
    decode_video,
)

# ---------------------------------------------------------------- images


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_allowed_image_formats_decode_to_rgb(make_image, fmt) -> None:
    img = decode_image(make_image(fmt=fmt), max_pixels=64 * 48)
    assert img.mode == "RGB" and img.size == (64, 48)
    assert np.asarray(img).shape == (48, 64, 3)


def test_format_outside_the_allowlist(make_image) -> None:
    with pytest.raises(MediaDecodeError):
        decode_image(make_image(fmt="TIFF"), max_pixels=10_000)
    with pytest.raises(MediaDecodeError):
        decode_image(make_image(fmt="JPEG"), max_pixels=10_000, formats=("PNG",))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_images_are_errors(make_image, fmt) -> None:
    data = make_image((256, 256), fmt=fmt, noise=True)
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


def test_pixel_cap_is_checked_from_the_header(make_image) -> None:
    bomb = _png_declaring(50_000, 50_000, make_image())
    with pytest.raises(MediaTooLargeError):
        decode_image(bomb, max_pixels=10**6)
    with pytest.raises(MediaTooLargeError):
        decode_image(make_image(), max_pixels=100)


def test_pillow_bomb_guard_is_an_error_too(make_image) -> None:
    # Our cap set above Pillow's: Pillow's own DecompressionBombError/Warning must still be errors.
    for side in (int((Image.MAX_IMAGE_PIXELS * 1.5) ** 0.5), int((Image.MAX_IMAGE_PIXELS * 3) ** 0.5)):
        with pytest.raises(MediaTooLargeError):
            decode_image(_png_declaring(side, side, make_image()), max_pixels=10**12)


def test_truncated_images_switched_on_elsewhere_is_refused(make_image, monkeypatch) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(InternalError):
        decode_image(make_image(), max_pixels=10**6)


# ---------------------------------------------------------------- video


def _video(fmt: str, codec: str, frames: int = 6, rate: int = 5, size: tuple[int, int] = (64, 48)) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            pixels = np.full((size[1], size[0], 3), i * 40, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return _video("mp4", "mpeg4")


@pytest.fixture(scope="module")
def webm() -> bytes:
    return _video("webm", "libvpx")


@pytest.mark.parametrize("name", ["mp4", "webm"])
def test_video_frames_are_counted_by_decoding(request, name) -> None:
    data = request.getfixturevalue(name)
    frames = decode_video(data, max_frames=10, max_seconds=5.0)
    assert len(frames) == 6
    assert all(f.shape == (48, 64, 3) and f.dtype == np.uint8 for f in frames)
    assert frames[0].mean() < frames[-1].mean()


@pytest.mark.parametrize("name", ["mp4", "webm"])
def test_video_caps(request, name) -> None:
    data = request.getfixturevalue(name)
    with pytest.raises(MediaTooLargeError):
        decode_video(data, max_frames=5, max_seconds=5.0)
    with pytest.raises(MediaTooLargeError):
        decode_video(data, max_frames=10, max_seconds=0.5)
    with pytest.raises(MediaTooLargeError):
        decode_video(data, max_frames=10, max_seconds=5.0, max_pixels=1000)


def test_video_garbage_and_truncation(mp4) -> None:
    with pytest.raises(MediaDecodeError):
        decode_video(b"\x00" * 1000, max_frames=10, max_seconds=5.0)
    with pytest.raises(MediaDecodeError):
        decode_video(mp4[: len(mp4) // 3], max_frames=10, max_seconds=5.0)


def test_video_containers_cannot_open_other_files_or_urls(servers, mp4, tmp_path) -> None:
    (tmp_path / "inner.mp4").write_bytes(mp4)
    scripts = [
        f"ffconcat version 1.0\nfile '{tmp_path / 'inner.mp4'}'\n",
        f"ffconcat version 1.0\nfile 'http://127.0.0.2:{servers.port}/inner.mp4'\n",
        f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nhttp://127.0.0.2:{servers.port}/seg.ts\n#EXT-X-ENDLIST\n",
    ]
    for script in scripts:
        with pytest.raises(MediaDecodeError):
            decode_video(script.encode(), max_frames=10, max_seconds=5.0)
    assert servers.internal_count() == 0


# ---------------------------------------------------------------- audio


def _wav(seconds: float, rate: int = 16_000, fmt: str = "WAV") -> bytes:
    """Stereo: a 440 Hz sine on the left, a constant 0.25 on the right."""
    t = np.arange(int(seconds * rate)) / rate
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    samples = np.stack([left, np.full_like(left, 0.25)], axis=1)
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_audio_decodes_to_mono_float32(fmt) -> None:
    samples, rate = decode_audio(_wav(1.0, fmt=fmt), max_seconds=2.0)
    assert rate == 16_000 and samples.dtype == np.float32 and samples.shape == (16_000,)
    assert abs(float(samples.mean()) - 0.125) < 0.01  # (sine + 0.25) / 2 averages to 0.125


def test_audio_duration_cap() -> None:
    with pytest.raises(MediaTooLargeError):
        decode_audio(_wav(1.0), max_seconds=0.5)


def test_audio_garbage_and_truncation() -> None:
    with pytest.raises(MediaDecodeError):
        decode_audio(b"RIFF\x00\x00garbage", max_seconds=5.0)
    with pytest.raises(MediaDecodeError):
        decode_audio(_wav(1.0, fmt="FLAC")[:40], max_seconds=5.0)
