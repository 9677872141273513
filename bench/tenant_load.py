"""What one key's load costs another key (issue #47, items 3 and 4), against ``rollout-queue api``
at its defaults (gunicorn, an embedded Redis, no workers: nothing ends a job, so every wait lasts).

Key A opens, in turn, 600 sockets of one kind (more than the defaults' 2 processes x 272
threads): a chunked body that trickles, ``Expect: 100-continue`` with no body, a whole request
then a second head begun (the slow senders that still reached a thread), then synchronous SGLang
``/generate`` calls (what slime keeps open, waiting for jobs). Meanwhile key B's ``GET /v1/jobs``
and ``/healthz`` are timed, 5 of each (a call that times out counts :data:`TIMEOUT_S`); beside
them the same with nothing open. A's sockets are closed after each round.

Then what one key's jobs cost another's in the GPU batch (issue #56 item 3: the livelock and tie
scenarios, :mod:`bench.tenant_scheduling`, which runs alone too).

    python -m bench.tenant_load
"""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import requests

from bench.http_service import start_api
from bench.stack import HEADERS, KEY, Service
from engine.demo_model import build_demo_model

OTHER_KEY = "bench-other-key"
JOB_HEAD = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
SOCKETS = 600
TIMEOUT_S = 10.0
SLOW_KINDS = {
    "chunked bodies that trickle": JOB_HEAD + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n",
    "Expect: 100-continue, no body": JOB_HEAD + b"Expect: 100-continue\r\nContent-Length: 10\r\n\r\n",
    "whole requests, then a second head begun": b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTT",
}


def open_sockets(port: int, payloads: list[bytes]) -> list[socket.socket]:
    sockets = []
    for payload in payloads:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(payload)
        sockets.append(sock)
    return sockets


def sync_calls(count: int) -> list[bytes]:
    body = json.dumps({"input_ids": [100, 101, 102], "sampling_params": {"max_new_tokens": 2}}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return [head + body] * count


def others_latency(url: str, samples: int = 5) -> tuple[float, float, float]:
    """Key B's GET /v1/jobs p50 and max, /healthz max (seconds; a timeout counts TIMEOUT_S)."""
    jobs, health = [], []
    for _ in range(samples):
        for path, headers, into in (("/v1/jobs", {"Authorization": f"Bearer {OTHER_KEY}"}, jobs),
                                    ("/healthz", {}, health)):
            started = time.perf_counter()
            try:
                requests.get(f"{url}{path}", headers=headers, timeout=TIMEOUT_S)
                into.append(time.perf_counter() - started)
            except requests.RequestException:
                into.append(TIMEOUT_S)
    return statistics.median(jobs), max(jobs), max(health)


def run() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "model")
        service = Service(Path(tmp) / "state", model_dir, workers=())
        service.env["ROLLOUT_API_KEYS"] = f"{KEY},{OTHER_KEY}"
        try:
            url = start_api(service)
            port = int(url.rsplit(":", 1)[1])
            assert requests.get(f"{url}/v1/jobs", headers=HEADERS, timeout=10).status_code == 200
            loads = {"nothing open": [],
                     **{f"{SOCKETS} {name}": [payload] * SOCKETS for name, payload in SLOW_KINDS.items()},
                     f"{SOCKETS} synchronous SGLang /generate calls": sync_calls(SOCKETS)}
            for name, payloads in loads.items():
                sockets = open_sockets(port, payloads)
                time.sleep(2.0)  # every one arrived and is held (or waits) where the server keeps it
                p50, worst, health = others_latency(url)
                for sock in sockets:
                    sock.close()
                rows += [{"name": f"{name}: key B's GET /v1/jobs p50 (s)", "value": round(p50, 4), "goal": "< 0.1"},
                         {"name": f"{name}: key B's GET /v1/jobs max (s)", "value": round(worst, 4), "goal": "< 1"},
                         {"name": f"{name}: /healthz max (s)", "value": round(health, 4), "goal": "< 1"}]
                time.sleep(1.0)
        finally:
            service.close()
    from bench import tenant_scheduling

    return rows + tenant_scheduling.run()


def main() -> None:
    from bench.rows import print_rows

    print_rows(run())


if __name__ == "__main__":
    main()
