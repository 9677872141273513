"""Video bytes to RGB frames with PyAV, within frame-count, duration and pixel caps."""

from __future__ import annotations

import io
from typing import Any

import av
import numpy as np

from .errors import MediaDecodeError, MediaTooLargeError

# FFmpeg demuxer names (matched against e.g. "mov,mp4,m4a,3gp,3g2,mj2"). Playlist and script
# demuxers (hls, concat, ...) are left out: they open further URLs and files by themselves.
VIDEO_FORMATS = ("mov", "matroska", "avi", "mpegts")


def _no_nested_io(url: str, flags: int, options: dict[str, Any]) -> Any:
    raise PermissionError("a media file may not open other files or URLs")


def decode_video(
    data: bytes,
    *,
    max_frames: int,
    max_seconds: float,
    max_pixels: int | None = None,
    formats: tuple[str, ...] = VIDEO_FORMATS,
) -> list[np.ndarray]:
    """All frames of the first video stream as HxWx3 uint8 RGB arrays.

    Frames are counted by decoding: container metadata (``stream.frames``) is 0 for webm/mkv
    and can be anything a file claims.
    """
    frames: list[np.ndarray] = []
    try:
        with av.open(
            io.BytesIO(data),
            container_options={"format_whitelist": ",".join(formats)},
            io_open=_no_nested_io,
        ) as container:
            if not container.streams.video:
                raise MediaDecodeError("the file has no video stream")
            stream = container.streams.video[0]
            if container.duration is not None and container.duration / av.time_base > max_seconds:
                raise MediaTooLargeError(f"the video is longer than {max_seconds} s")
            if max_pixels is not None and stream.width * stream.height > max_pixels:
                raise MediaTooLargeError(f"the video frames have more than {max_pixels} pixels")
            for frame in container.decode(stream):
                if len(frames) >= max_frames:
                    raise MediaTooLargeError(f"the video has more than {max_frames} frames")
                if frame.time is not None and frame.time > max_seconds:
                    raise MediaTooLargeError(f"the video is longer than {max_seconds} s")
                if max_pixels is not None and frame.width * frame.height > max_pixels:
                    raise MediaTooLargeError(f"the video frames have more than {max_pixels} pixels")
                frames.append(frame.to_ndarray(format="rgb24"))
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaDecodeError("the video cannot be decoded") from exc
    if not frames:
        raise MediaDecodeError("the video has no frames")
    return frames
