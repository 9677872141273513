"""Video bytes to frames sampled at a target rate, with PyAV, within duration, frame and pixel caps.

Frames are counted and timed by decoding: container metadata (``stream.frames`` is 0 for
webm/mkv) can be anything a file claims. The declared duration is only used to lower the sampling
rate so that a long video still fits ``max_frames`` (spread over the whole video, not its start);
a file that lies about it is still held to the caps while decoding, and decoding stops as soon as
one is passed or enough frames are sampled.

Memory is bounded before FFmpeg allocates: a frame's size is what its packet says, not the header
(a 1 KB mov whose header says 16x16 held a 16000x16000 16-bit PNG: 1.5 GB, and 12 GB for 8 such
streams, all probed when the file opened). So the pixel cap is FFmpeg's own ``max_pixels`` for the
streams probed at open and for the decoder (a larger frame is an error, never an allocation), a
file may hold at most :data:`MAX_STREAMS` streams, only the first video stream is decoded, and only
video codecs are decoded as video (:data:`VIDEO_CODECS`: no still-image codec such as png or mjpeg,
whose every packet is a new picture of any size). What one decode holds is then about
``max_frames x max_pixels x 3`` bytes of sampled frames plus a few frames of decoder state.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from processors.fetch.errors import MediaDecodeError, MediaTooLargeError

# FFmpeg demuxer names (matched against e.g. "mov,mp4,m4a,3gp,3g2,mj2"). Playlist and script
# demuxers (hls, concat, ...) are left out: they open further URLs and files by themselves.
VIDEO_FORMATS = ("mov", "matroska", "avi", "mpegts")
# Highest frame rate in real use: a stream holding more frames per second of video than this
# (say a million frames in a short clip) is refused after max_seconds * MAX_FRAME_RATE decoded
# frames, so decoding time stays bounded by the duration cap.
MAX_FRAME_RATE = 240
# Streams a video file may hold (video, audio, subtitles, data): each is probed when it opens.
MAX_STREAMS = 8
# Codecs decoded as video (FFmpeg decoder names): motion codecs in real use. Still-image codecs
# (png, mjpeg, bmp, tiff, webp, ...) are refused: each of their packets sets its own frame size.
VIDEO_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "libvpx", "libvpx-vp9", "mpeg4",
                          "mpeg2video", "mpeg1video", "h263", "theora", "prores", "dnxhd", "vc1", "wmv1",
                          "wmv2", "wmv3", "msmpeg4", "msmpeg4v2", "msmpeg4v3", "flv"})


@dataclass(frozen=True)
class VideoSampling:
    max_seconds: float = 600.0  # longest video
    max_frames: int = 32  # most frames sampled
    fps: float = 2.0  # frames sampled per second of video (lowered to fit max_frames)
    max_pixels: int = 1920 * 1088  # decoded size of one frame

    def __post_init__(self) -> None:
        if self.max_seconds <= 0 or self.max_frames < 1 or self.fps <= 0 or self.max_pixels < 1:
            raise ValueError("video sampling limits must be positive")


@dataclass(frozen=True)
class DecodedVideo:
    frames: np.ndarray  # (T, H, W, 3) uint8 RGB, T >= 1
    fps: float  # the sampling rate used: frames per second of video time
    duration: float  # seconds of video the frames span (the last sampled frame's time)


def _no_nested_io(url: str, flags: int, options: dict[str, Any]) -> Any:
    raise PermissionError("a media file may not open other files or URLs")


def decode_video(
    data: bytes, sampling: VideoSampling, *, formats: tuple[str, ...] = VIDEO_FORMATS
) -> DecodedVideo:
    """Frames of the first video stream, one per ``1 / fps`` seconds of video time."""
    frames: list[np.ndarray] = []
    last_time, decoding = 0.0, False
    try:
        bounded = {"max_pixels": str(sampling.max_pixels)}  # FFmpeg refuses larger frames, never allocates them
        with av.open(
            io.BytesIO(data),
            options=bounded,
            container_options={"format_whitelist": ",".join(formats)},
            io_open=_no_nested_io,
        ) as container:
            if len(container.streams) > MAX_STREAMS:
                raise MediaTooLargeError(f"the video file has more than {MAX_STREAMS} streams")
            if not container.streams.video:
                raise MediaDecodeError("the file has no video stream")
            stream = container.streams.video[0]
            codec = stream.codec_context.name
            if codec not in VIDEO_CODECS:
                raise MediaDecodeError(f"the video stream's codec {codec!r} is not a video codec served here")
            if not stream.width or not stream.height:  # probing refused its first frame under max_pixels
                raise MediaTooLargeError(f"the video frames have more than {sampling.max_pixels} pixels")
            stream.codec_context.options = bounded
            declared = _declared_seconds(container, stream)
            if declared is not None and declared > sampling.max_seconds:
                raise MediaTooLargeError(f"the video is longer than {sampling.max_seconds} s")
            if stream.width * stream.height > sampling.max_pixels:
                raise MediaTooLargeError(f"the video frames have more than {sampling.max_pixels} pixels")
            fps = sampling.fps
            if declared:  # spread max_frames over the whole video
                fps = min(fps, sampling.max_frames / declared)
            step = 1.0 / fps
            rate = float(stream.average_rate) if stream.average_rate else None
            budget = int(sampling.max_seconds * MAX_FRAME_RATE) + 1
            next_time = 0.0
            decoding = True
            for decoded, frame in enumerate(container.decode(stream)):
                if decoded >= budget:
                    raise MediaTooLargeError(
                        f"the video has more frames than {sampling.max_seconds} s at {MAX_FRAME_RATE} fps"
                    )
                time = _frame_time(frame, decoded, rate)
                if time > sampling.max_seconds:
                    raise MediaTooLargeError(f"the video is longer than {sampling.max_seconds} s")
                if frame.width * frame.height > sampling.max_pixels:
                    raise MediaTooLargeError(f"the video frames have more than {sampling.max_pixels} pixels")
                if time + 1e-6 < next_time:
                    continue
                if frames and frames[0].shape[:2] != (frame.height, frame.width):
                    raise MediaDecodeError("the video changes its frame size midway")
                frames.append(frame.to_ndarray(format="rgb24"))
                last_time = time
                while next_time <= time + 1e-6:
                    next_time += step
                if len(frames) == sampling.max_frames:
                    break  # enough: the rest is never decoded
    except av.error.ArgumentError as exc:
        if decoding:  # EINVAL from the decoder: a frame past max_pixels (opening gives EINVAL for much else)
            raise MediaTooLargeError(f"the video frames have more than {sampling.max_pixels} pixels") from exc
        raise MediaDecodeError("the video cannot be decoded") from exc
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaDecodeError("the video cannot be decoded") from exc
    if not frames:
        raise MediaDecodeError("the video has no frames")
    if len(frames) > 1 and last_time > 0:
        # A source slower than the target rate gives every frame it has: report the real rate.
        fps = min(fps, (len(frames) - 1) / last_time)
    return DecodedVideo(np.stack(frames), fps, last_time)


def _declared_seconds(container, stream) -> float | None:
    """What the file says its length is; None when it says nothing (or nothing positive)."""
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / av.time_base
    else:
        return None
    return seconds if seconds > 0 else None


def _frame_time(frame, index: int, rate: float | None) -> float:
    if frame.time is not None:
        return max(0.0, float(frame.time))
    if rate:
        return index / rate
    raise MediaDecodeError("the video frames carry no timestamps and the stream no frame rate")
