"""Audio bytes to mono float32 samples with soundfile, within a duration cap."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf

from .errors import MediaDecodeError, MediaTooLargeError

# Highest sample rate in real use (768 kHz DXD); a file claiming more is refused, since the
# duration cap alone would let a forged rate ask for gigabytes of samples.
MAX_SAMPLE_RATE = 768_000
BLOCK_FRAMES = 64 * 1024


def decode_audio(data: bytes, *, max_seconds: float) -> tuple[np.ndarray, int]:
    """(mono float32 samples, sample rate). Channels are averaged block by block."""
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            rate = f.samplerate
            if not 0 < rate <= MAX_SAMPLE_RATE:
                raise MediaDecodeError("the audio has an unsupported sample rate")
            cap = int(max_seconds * rate)
            # f.frames is what the header claims; the read below enforces the cap regardless.
            if f.frames > cap:
                raise MediaTooLargeError(f"the audio is longer than {max_seconds} s")
            blocks = []
            total = 0
            for block in f.blocks(blocksize=BLOCK_FRAMES, dtype="float32", always_2d=True):
                total += len(block)
                if total > cap:
                    raise MediaTooLargeError(f"the audio is longer than {max_seconds} s")
                blocks.append(block.mean(axis=1, dtype=np.float32))
    except (sf.SoundFileError, RuntimeError, TypeError, ValueError) as exc:
        # libsndfile errors (unknown format, corrupt data) are SoundFileError/RuntimeError.
        raise MediaDecodeError("the audio cannot be decoded") from exc
    if not blocks:
        raise MediaDecodeError("the audio has no samples")
    return np.concatenate(blocks).astype(np.float32, copy=False), rate
