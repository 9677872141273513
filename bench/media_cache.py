"""Preprocessing of a repeated video and a repeated audio clip: cache hit / miss (goal: <= 0.1).

Each figure is the median time of ``processors.pipeline.preprocess`` (fetch of a data: URL,
decode, model processor, finalize with the node-local ``shm`` transport) on the demo model
``rollout-queue up`` serves (the tiny Qwen2.5-Omni thinker), with the multimodal cache in use:

- video: 8 s of 320x240 at 25 fps (mpeg4), sampled at 2 fps to 16 frames;
- audio: 10 s of 44.1 kHz stereo 16-bit WAV, resampled to 16 kHz, Whisper features of the 30 s window.

A miss empties the cache first (so it pays its lookup and store); a hit is the same clip again
in the same worker process. Clips are keyed by the sha256 of their bytes (no uuid), so a hit
still fetches and hashes them and skips the decode and the processor; a hit by uuid (reported)
skips the fetch too. The audio ratio is the hard one: its miss is cheap (Whisper features are
numpy, 30-55 ms) while a content-keyed hit still decodes and hashes the clip, 1.8 MB of 16-bit WAV
(2.4 MB as a data: URL) for these 10 s. With the stdlib's base64 decoder that was 5 of the hit's
8 ms (0.16); pybase64's takes 0.13 ms, the sha256 ~1 ms (a hit by uuid is ~0.015).

Run: ``python -m bench.media_cache`` from the repository root; ``run()`` returns the rows.
"""

from __future__ import annotations

import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import av  # noqa: E402
import numpy as np  # noqa: E402
import redis  # noqa: E402
import soundfile as sf  # noqa: E402
import torch  # noqa: E402

from bench.rows import print_rows  # noqa: E402
from domain.infra.redis_server import EmbeddedRedis  # noqa: E402
from domain.infra.transport_acks import RedisAckChannel  # noqa: E402
from engine.demo_model import SERVED_ARCH, build_demo_model  # noqa: E402
from engine.limits import Limits  # noqa: E402
from engine.transport import acknowledge, make_transport  # noqa: E402
from processors.cache import MultimodalCache  # noqa: E402
from processors.fetch import FetchPolicy, GuardedFetcher  # noqa: E402
from processors.pipeline import preprocess  # noqa: E402
from processors.registry import load_processor  # noqa: E402

MISS_RUNS, HIT_RUNS = 5, 15


def video_url(seconds: int = 8, fps: int = 25, size: tuple[int, int] = (320, 240)) -> str:
    """A smooth moving gradient (noise would make the encoder, not the pipeline, the cost)."""
    buffer = io.BytesIO()
    y, x = np.mgrid[0:size[1], 0:size[0]] / size[0]
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(seconds * fps):
            phase = i / fps
            pixels = np.stack([np.sin(9 * x + phase), np.cos(7 * y - phase), x * y * 2 - 1], axis=-1)
            frame = av.VideoFrame.from_ndarray(((pixels + 1) * 127.5).astype(np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()


def audio_url(seconds: int = 10, rate: int = 44_100) -> str:
    t = np.arange(seconds * rate) / rate
    samples = np.stack([0.4 * np.sin(2 * np.pi * 220 * t), 0.3 * np.sin(2 * np.pi * 330 * t)], axis=1)
    buffer = io.BytesIO()
    sf.write(buffer, samples.astype(np.float32), rate, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


def run() -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", persistent=False).start()
        client = redis.Redis.from_url(server.url)
        acks = RedisAckChannel(client)
        transport = make_transport("shm", acks=acks, capacity_bytes=512 << 20)
        try:
            processor = load_processor(build_demo_model(Path(tmp) / "model", arch=SERVED_ARCH))
            fetcher = GuardedFetcher(FetchPolicy(max_bytes=64 << 20))
            cache = MultimodalCache(client, max_bytes=1 << 30, namespace="bench:media")

            def once(kind: str, url: str, uuid: str | None = None) -> float:
                part = {"type": f"{kind}_url", "url": url, **({"uuid": uuid} if uuid else {})}
                request = {"prompt": f"<{kind}> Describe it.", "content_parts": [part]}
                started = time.perf_counter()
                # An owner, as every job has: entries by uuid are private to one (processors.cache).
                result = preprocess(request, processor=processor, fetcher=fetcher, cache=cache, transport=transport,
                                    limits=Limits(), owner="bench-key")
                elapsed = time.perf_counter() - started
                acknowledge(acks, [f for item in result.items for f in item.features.values()])
                transport.reap()
                return elapsed

            for kind, label, url in (("video", "video 8 s 320x240 25 fps", video_url()),
                                     ("audio", "audio 10 s 44.1 kHz", audio_url())):
                misses = []
                for _ in range(MISS_RUNS):
                    cache.clear()
                    misses.append(once(kind, url))
                once(kind, url)  # warm
                hits = [once(kind, url) for _ in range(HIT_RUNS)]
                once(kind, url, uuid=kind)  # stored under its uuid
                named = [once(kind, url, uuid=kind) for _ in range(HIT_RUNS)]
                miss, hit, by_uuid = (statistics.median(v) for v in (misses, hits, named))
                rows += [
                    {"name": f"preprocess {label} cache miss", "value": round(miss * 1e3, 2), "goal": None,
                     "unit": "ms"},
                    {"name": f"preprocess {label} cache hit", "value": round(hit * 1e3, 2), "goal": None, "unit": "ms"},
                    {"name": f"preprocess {label} cache hit / miss", "value": round(hit / miss, 3),
                     "goal": "<= 0.1", "unit": "ratio"},
                    {"name": f"preprocess {label} cache hit by uuid (no fetch) / miss", "value": round(by_uuid / miss, 3),
                     "goal": None, "unit": "ratio"},
                ]
        finally:
            transport.close()
            server.stop()
    return rows


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
