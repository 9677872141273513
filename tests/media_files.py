"""Small media files made in the tests (seeded, so repeatable): PNG, mp4 with PyAV, WAV with soundfile."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def mp4_bytes(frames: int = 4, width: int = 64, height: int = 48, seed: int = 0, rate: int = 2) -> bytes:
    """A noise video (seeded): ``frames`` frames at ``rate`` fps, mpeg4 in mp4."""
    import av

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def wav_bytes(seconds: float = 1.0, rate: int = 16_000, seed: int = 0) -> bytes:
    """A mono tone with a little seeded noise."""
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    samples = 0.4 * np.sin(2 * np.pi * 330 * t) + 0.05 * np.random.default_rng(seed).standard_normal(len(t))
    buffer = io.BytesIO()
    sf.write(buffer, samples.astype(np.float32), rate, format="WAV")
    return buffer.getvalue()
