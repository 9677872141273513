"""Media bytes to pixels, frames or samples, each decoder under its own caps.

``decode_image`` gives a fully loaded RGB Pillow image; ``decode_video`` samples frames at a target
rate into one (T, H, W, 3) array; ``decode_audio`` gives mono float32 samples, resampled to the
rate the model's feature extractor takes. Containers are never trusted: frame counts and
durations come from decoding, and decoding stops as soon as a cap is passed.

Errors (from ``processors.fetch.errors``): :class:`MediaTooLargeError` (a cap), and
:class:`MediaDecodeError` for anything that is not a readable file of an allowed format.
"""

from .audio import AUDIO_FORMATS, DecodedAudio, decode_audio
from .images import IMAGE_FORMATS, decode_image
from .video import VIDEO_FORMATS, DecodedVideo, VideoSampling, decode_video

__all__ = [
    "AUDIO_FORMATS",
    "IMAGE_FORMATS",
    "VIDEO_FORMATS",
    "DecodedAudio",
    "DecodedVideo",
    "VideoSampling",
    "decode_audio",
    "decode_image",
    "decode_video",
]
