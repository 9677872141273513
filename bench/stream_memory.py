"""What an unread stream of a finished job costs the API process, per byte of the job's result.

The API as a user runs it (``rollout-queue api``: gunicorn, one worker process) on an embedded
Redis, no workers: jobs are submitted over HTTP and ended through the job store with a large
result shaped as the GPU worker writes one (one choice of many tokens with their logprobs and 20
top logprobs each, float32 values as the engine's, some near zero, text with characters past
ASCII). Then streams of ``/v1/jobs/{id}/events`` are opened on raw sockets with a small receive
buffer whose clients never read, and the API worker's resident memory is read once it settles.
Reported: the growth per stream over the result's size (stored bytes), for streams of one job and
for streams of as many jobs. Each case runs in an API process of its own, so memory an earlier
case freed is not reused. The write timeout is raised so no stream is dropped while measured.

Run: ``python -m bench.stream_memory [--mb 8] [--streams 6]`` from the repository root (~30 s).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import redis
import requests

from bench.http_service import _children
from bench.rows import print_rows
from domain.infra.redis_server import EmbeddedRedis, free_port
from domain.settings import Settings
from engine.demo_model import build_demo_model
from workers.runtime import Runtime

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
TOP = 20
BYTES_PER_TOKEN = 590  # about, in the stored JSON, with TOP top logprobs


def _f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def large_result(tokens: int, seed: int = 0) -> dict:
    """A stored generation result of ``tokens`` tokens with their logprobs and top logprobs."""
    rnd = random.Random(seed)
    logprobs = [_f32(-rnd.expovariate(1e4) if rnd.random() < 0.5 else -rnd.expovariate(0.5)) for _ in range(tokens)]
    top = [[[rnd.randrange(150_000), _f32(-rnd.expovariate(0.2))] for _ in range(TOP)] for _ in range(tokens)]
    return {"prompt_token_ids": list(range(100, 1100)), "placeholder_ranges": [], "weight_version": "53be6cda0767685f",
            "timings": {"prefill_s": 0.0131, "decode_s": 9.97}, "transport": "inline",
            "nodes": {"preprocess": "", "generate": "bench-node"},
            "choices": [{"index": 0, "token_ids": [rnd.randrange(150_000) for _ in range(tokens)],
                         "logprobs": logprobs, "finish_reason": "length", "matched_stop": None,
                         "text": "résumé — 😀 " * (tokens // 4), "top_logprobs": top}],
            "usage": {"prompt_tokens": 1000, "completion_tokens": tokens}, "cached_tokens": 0}


class Api:
    """``rollout-queue api`` with one worker process on a free port; ``rss()`` is that worker's."""

    def __init__(self, redis_url: str, model_dir: Path, state: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
        env.update({"ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_MODEL": str(model_dir), "ROLLOUT_STATE_DIR": str(state),
                    "ROLLOUT_API_KEYS": KEY, "ROLLOUT_PORT": str(self.port), "ROLLOUT_API_WORKERS": "1",
                    "ROLLOUT_LOG_LEVEL": "WARNING", "ROLLOUT_STREAM_WRITE_TIMEOUT": "600"})
        self.log = state / "api.log"
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "launcher.cli", "api"], cwd=ROOT, env=env,
                                            stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the API exited:\n{self.log.read_text()[-3000:]}")
            try:
                requests.get(f"{self.url}/openapi.json", timeout=10)
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        [self.worker] = _children(self.process.pid)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.worker}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def settled_rss(self, quiet_s: float = 1.5, timeout_s: float = 60) -> int:
        """The worker's RSS once it moved less than 1 MiB for ``quiet_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        last, since = self.rss(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = self.rss()
            if abs(now - last) > 1 << 20:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return now
        return self.rss()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def ended_jobs(api: Api, rt: Runtime, count: int, result: dict) -> list[str]:
    ids = []
    for i in range(count):
        job = requests.post(f"{api.url}/v1/jobs", headers=HEADERS, timeout=30,
                            json={"token_ids": [100 + i], "sampling_params": {"max_tokens": 1}}).json()
        assert rt.jobs.advance(job["id"], "succeeded", result=result)
        ids.append(job["id"])
    return ids


def unread_stream(port: int, job_id: str) -> socket.socket:
    """A stream whose client reads its head and nothing more."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    head = sock.recv(1024)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def per_stream(redis_url: str, model_dir: Path, state: Path, result: dict, streams: int, *, distinct: bool) -> float:
    """The API worker's RSS growth per unread stream, in bytes."""
    api = Api(redis_url, model_dir, state)
    try:
        rt = Runtime(Settings(redis_url=redis_url, state_dir=state, api_keys=(KEY,)), redis_url)
        ids = ended_jobs(api, rt, streams if distinct else 1, result)
        small = ended_jobs(api, rt, 1, {"choices": []})[0]
        requests.get(f"{api.url}/v1/jobs/{small}/events", headers=HEADERS, timeout=30).raise_for_status()  # warm
        before = api.settled_rss()
        socks = [unread_stream(api.port, ids[i % len(ids)]) for i in range(streams)]
        grown = api.settled_rss() - before
        for sock in socks:
            sock.close()
        return grown / streams
    finally:
        api.close()


def run(mb: float = 8.0, streams: int = 6) -> list[dict]:
    result = large_result(int(mb * 1e6 / BYTES_PER_TOKEN))
    size = len(orjson.dumps(result))
    with tempfile.TemporaryDirectory(prefix="rq-bench-stream-memory-") as tmp:
        state = Path(tmp)
        model_dir = build_demo_model(state / "model")
        server = EmbeddedRedis(state / "redis", persistent=False).start()
        try:
            one = per_stream(server.url, model_dir, state, result, streams, distinct=False)
            redis.Redis.from_url(server.url).flushdb()
            each = per_stream(server.url, model_dir, state, result, streams, distinct=True)
        finally:
            server.stop()
    return [
        {"name": f"{streams} unread streams of one job ({size / 1e6:.1f} MB result): API RSS per stream / result",
         "value": round(one / size, 2), "goal": "<= 1.5"},
        {"name": f"{streams} unread streams of {streams} jobs ({size / 1e6:.1f} MB results): API RSS per stream / result",
         "value": round(each / size, 2), "goal": "<= 1.5"},
        {"name": f"· per stream: {one / 2**20:.1f} MiB (one job), {each / 2**20:.1f} MiB (a job each)",
         "value": round(each / 2**20, 1), "goal": ""},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=8.0, help="the result's stored size, about")
    parser.add_argument("--streams", type=int, default=6)
    args = parser.parse_args()
    print_rows(run(args.mb, args.streams))


if __name__ == "__main__":
    main()
