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


def png_bomb_mov(streams: int = 1, side: int = 16_000) -> bytes:
    """A mov of ``streams`` png video streams whose headers say 16x16 while each frame's PNG says
    ``side`` x ``side`` at 16 bits per channel (its data truncated): ~1 KB that FFmpeg would decode
    into a 1.5 GB frame per stream. Built by encoding a real 16x16 frame and rewriting the PNG's
    IHDR in place (same length, so the container's offsets hold)."""
    import struct
    import zlib

    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mov") as container:
        outs = [container.add_stream("png", rate=1) for _ in range(streams)]
        for stream in outs:  # every stream's size before the first packet writes the header
            stream.width, stream.height, stream.pix_fmt = 16, 16, "rgb24"
        for stream in outs:
            frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
            for packet in [*stream.encode(frame), *stream.encode()]:
                container.mux(packet)
    data = bytearray(buffer.getvalue())
    at = 0
    while (at := data.find(b"IHDR", at)) != -1:
        body = struct.pack(">IIBBBBB", side, side, 16, 2, 0, 0, 0)  # width, height, 16-bit RGB
        data[at + 4: at + 17] = body
        data[at + 17: at + 21] = struct.pack(">I", zlib.crc32(b"IHDR" + body))
        at += 4
    return bytes(data)
