"""Video decoding stays under its memory ceiling for any input under the byte cap (#26): a few-KB
file whose frames claim a huge size is refused before FFmpeg allocates them. Peak RSS is measured
in a fresh process around the decode: its VmHWM (ru_maxrss would carry the forking pytest's own
high-water mark across the exec)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.media_files import png_bomb_mov

ROOT = Path(__file__).resolve().parents[3]
# The documented ceiling of one decode at the default caps (32 frames of 1920x1088 RGB, ~200 MB)
# plus the interpreter, numpy and PyAV (~60 MB here); the bombs below took 1.5 GB and 12 GB.
CEILING_MB = 400

_MEASURE = """
import json, sys
from processors.decode.video import VideoSampling, decode_video
data = open(sys.argv[1], "rb").read()
try:
    decode_video(data, VideoSampling())
    outcome = "decoded"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
status = open("/proc/self/status").read()
peak_kb = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])
print(json.dumps({"outcome": outcome, "peak_mb": peak_kb / 1024}))
"""


def _decode_in_fresh_process(tmp_path, data: bytes) -> dict:
    path = tmp_path / "video.mov"
    path.write_bytes(data)
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("streams", [1, 8])
def test_a_png_bomb_is_refused_under_the_ceiling(tmp_path, streams):
    data = png_bomb_mov(streams)
    assert len(data) < 8 * 1024
    measured = _decode_in_fresh_process(tmp_path, data)
    assert measured["outcome"].startswith("MediaDecodeError") and "png" in measured["outcome"], measured
    assert measured["peak_mb"] < CEILING_MB, measured


def test_too_many_streams_are_refused(tmp_path):
    measured = _decode_in_fresh_process(tmp_path, png_bomb_mov(9, side=16))
    assert measured["outcome"].startswith("MediaTooLargeError") and "streams" in measured["outcome"], measured


def test_a_real_video_still_decodes_in_the_same_harness(tmp_path):
    from tests.media_files import mp4_bytes

    measured = _decode_in_fresh_process(tmp_path, mp4_bytes(frames=4))
    assert measured["outcome"] == "decoded" and measured["peak_mb"] < CEILING_MB, measured
