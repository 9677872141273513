"""Preprocessing of a repeated image: cache hit / cache miss (goal: <= 0.1), side by side.

Each figure is the median time of ``processors.pipeline.preprocess`` (fetch, decode, image
processor, finalize with the node-local ``shm`` transport) for one image of 448x448 and of
1024x1024 on the demo Qwen2-VL, with the multimodal cache in use:

- miss: the cache is emptied before every run (so a miss pays its lookup and its store too);
- hit: the same image again in the same worker process (the cache's in-memory tier);
- hit via Redis: as another worker of the node sees it (local tier emptied before each run;
  reported, not a goal: it pays the Redis transfer and the deserialization);
- no cache: the pipeline without a cache at all (reported: a miss costs this plus the store).

Images are keyed by the sha256 of their bytes (no uuid), so every hit still fetches them. The
processor runs with Qwen2-VL's stock pixel bounds, so 1024x1024 is processed at full resolution
(1369 image tokens) as the real model would, not capped by the demo model's small default.

Run: ``python -m bench.preprocess_cache`` (or ``python bench/preprocess_cache.py``) from the
repository root; ``run()`` returns the rows ``{name, value, goal, unit}``.
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
    # Run as a file, bench/ comes first on sys.path; the repository root must.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bench.rows import print_rows  # noqa: E402
from domain.infra.redis_server import EmbeddedRedis  # noqa: E402
from domain.infra.transport_acks import RedisAckChannel  # noqa: E402
from engine.demo_model import build_demo_model  # noqa: E402
from engine.limits import Limits  # noqa: E402
from engine.transport import acknowledge, make_transport  # noqa: E402
from processors.cache import MultimodalCache  # noqa: E402
from processors.fetch import FetchPolicy, GuardedFetcher  # noqa: E402
from processors.pipeline import preprocess  # noqa: E402
from processors.registry import load_processor  # noqa: E402

SIZES = (448, 1024)
MISS_RUNS, HIT_RUNS = 5, 15
# Qwen2-VL's own preprocessor_config bounds (min_pixels, max_pixels).
OPTIONS = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}}


def photo_url(side: int) -> str:
    """A smooth, photo-like JPEG (noise would make decoding, not processing, the cost)."""
    y, x = np.mgrid[0:side, 0:side] / side
    pixels = np.stack([np.sin(9 * x + 3 * y), np.cos(7 * y - 2 * x), x * y * 2 - 1], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(((pixels + 1) * 127.5).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def run(sizes: tuple[int, ...] = SIZES) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", persistent=False).start()
        client = redis.Redis.from_url(server.url)
        acks = RedisAckChannel(client)
        transport = make_transport("shm", acks=acks, capacity_bytes=512 << 20)
        try:
            processor = load_processor(build_demo_model(Path(tmp) / "model"))
            fetcher = GuardedFetcher(FetchPolicy(max_bytes=64 << 20))
            cache = MultimodalCache(client, max_bytes=1 << 30, namespace="bench:mm")

            def once(url: str, cache: MultimodalCache | None = cache) -> float:
                request = {"prompt": "<image> Describe the picture.", "content_parts": [{"type": "image_url", "url": url}]}
                started = time.perf_counter()
                result = preprocess(request, processor=processor, fetcher=fetcher, cache=cache, transport=transport,
                                    limits=Limits(), options=OPTIONS)
                elapsed = time.perf_counter() - started
                # What the GPU worker does once it has the tensors: frees the shm regions.
                acknowledge(acks, [f for item in result.items for f in item.features.values()])
                transport.reap()
                return elapsed

            for side in sizes:
                url = photo_url(side)
                misses = []
                for _ in range(MISS_RUNS):
                    cache.clear()
                    misses.append(once(url))
                once(url)  # warm
                hits = [once(url) for _ in range(HIT_RUNS)]
                shared = []
                for _ in range(MISS_RUNS):
                    cache.clear_local()
                    shared.append(once(url))
                uncached = [once(url, None) for _ in range(MISS_RUNS)]
                miss, hit, via_redis, bare = (statistics.median(v) for v in (misses, hits, shared, uncached))
                rows += [
                    {"name": f"preprocess {side}x{side} cache miss", "value": round(miss * 1e3, 2), "goal": None,
                     "unit": "ms"},
                    {"name": f"preprocess {side}x{side} cache hit", "value": round(hit * 1e3, 2), "goal": None,
                     "unit": "ms"},
                    {"name": f"preprocess {side}x{side} no cache", "value": round(bare * 1e3, 2), "goal": None,
                     "unit": "ms"},
                    {"name": f"preprocess {side}x{side} cache hit / miss", "value": round(hit / miss, 3),
                     "goal": "<= 0.1", "unit": "ratio"},
                    {"name": f"preprocess {side}x{side} cache hit / no cache", "value": round(hit / bare, 3),
                     "goal": None, "unit": "ratio"},
                    {"name": f"preprocess {side}x{side} hit via Redis (other worker) / miss",
                     "value": round(via_redis / miss, 3), "goal": None, "unit": "ratio"},
                ]
        finally:
            transport.close()
            server.stop()
    return rows


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
