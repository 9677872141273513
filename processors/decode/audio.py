"""Audio bytes to mono float32 samples with soundfile, resampled with PyAV, within a duration cap.

soundfile (libsndfile) reads the formats in :data:`AUDIO_FORMATS` block by block, so a cap stops
the read where it is passed; PyAV's resampler (libswresample) brings the samples to the rate the
model's feature extractor takes, which refuses any other rate.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np
import soundfile as sf

from processors.fetch.errors import MediaDecodeError, MediaTooLargeError

AUDIO_FORMATS = ("WAV", "FLAC", "OGG", "MP3")
# Real recordings lie between telephone speech (8 kHz) and 768 kHz DXD. A file claiming a rate
# outside a wider band is refused: a forged high rate would ask for gigabytes of samples within
# the duration cap, and a rate of a few Hz is no recording (resampling it is meaningless).
MIN_SAMPLE_RATE = 1_000
MAX_SAMPLE_RATE = 768_000
BLOCK_FRAMES = 64 * 1024


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray  # (N,) float32 mono, N >= 1
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def decode_audio(
    data: bytes, *, max_seconds: float, sample_rate: int | None = None,
    formats: tuple[str, ...] = AUDIO_FORMATS,
) -> DecodedAudio:
    """Mono samples (channels averaged block by block), at ``sample_rate`` when given."""
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.format not in formats:
                raise MediaDecodeError(f"audio format {f.format} is not allowed")
            rate = f.samplerate
            if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
                raise MediaDecodeError(
                    f"the audio's sample rate is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz"
                )
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
    except (sf.SoundFileError, sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        # libsndfile errors (unknown format, corrupt data) are SoundFileError/RuntimeError.
        raise MediaDecodeError("the audio cannot be decoded") from exc
    if not blocks or total == 0:
        raise MediaDecodeError("the audio has no samples")
    samples = np.concatenate(blocks).astype(np.float32, copy=False)
    if sample_rate is not None and sample_rate != rate:
        samples = _resample(samples, rate, sample_rate)
    return DecodedAudio(samples, sample_rate or rate)


def _resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    out = []
    for start in range(0, len(samples), BLOCK_FRAMES):
        frame = av.AudioFrame.from_ndarray(samples[None, start:start + BLOCK_FRAMES], format="flt", layout="mono")
        frame.sample_rate = rate
        out.extend(f.to_ndarray()[0] for f in resampler.resample(frame))
    out.extend(f.to_ndarray()[0] for f in resampler.resample(None))  # flush what it holds back
    if not out:
        raise MediaDecodeError("the audio is too short to resample")
    return np.concatenate(out).astype(np.float32, copy=False)
