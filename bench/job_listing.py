"""What ``GET /v1/jobs`` costs when the key's history holds a large result (issue #56, item 6).

The API in this process (Flask test client) on an embedded Redis, no workers: jobs are submitted
over the API and ended through the job store, the newest with a large result shaped as the GPU
worker writes one (``bench.stream_memory.large_result``: one choice, 20 top logprobs a token).
Reported: the median time of ``GET /v1/jobs?limit=1`` (the large job is the page) and of
``?limit=20`` (it is one of 20 jobs), and the reply's size; the goal is a listing whose time does
not grow with the results it lists.

Run: ``python -m bench.job_listing [--mb 16.8] [--rounds 5]`` from the repository root (~30 s).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import orjson

from bench.rows import print_rows
from bench.stream_memory import BYTES_PER_TOKEN, large_result
from domain.infra.redis_server import EmbeddedRedis
from domain.settings import Settings
from engine.demo_model import build_demo_model
from web.app import create_app

KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _median_ms(client, path: str, rounds: int) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(rounds):
        started = time.perf_counter()
        response = client.get(path, headers=HEADERS)
        times.append(time.perf_counter() - started)
        assert response.status_code == 200, response.get_data(as_text=True)[:300]
        size = len(response.get_data())
    return statistics.median(times) * 1000, size


def run(mb: float = 16.8, rounds: int = 5) -> list[dict]:
    result = large_result(int(mb * 1e6 / BYTES_PER_TOKEN))
    stored = len(orjson.dumps(result))
    with tempfile.TemporaryDirectory(prefix="rq-bench-job-listing-") as tmp:
        state = Path(tmp)
        model_dir = build_demo_model(state / "model")
        server = EmbeddedRedis(state / "redis", persistent=False).start()
        try:
            app = create_app(Settings(state_dir=state, model=str(model_dir), api_keys=(KEY,)), server.url)
            client, jobs = app.test_client(), app.extensions["rollout"].jobs
            for i in range(20):
                job = client.post("/v1/jobs", json={"token_ids": [100 + i], "sampling_params": {"max_tokens": 1}},
                                  headers=HEADERS).get_json()
                assert jobs.advance(job["id"], "succeeded", result=result if i == 19 else {"choices": []})
            one, one_size = _median_ms(client, "/v1/jobs?limit=1", rounds)
            twenty, twenty_size = _median_ms(client, "/v1/jobs?limit=20", rounds)
        finally:
            server.stop()
    label = f"{stored / 1e6:.1f} MB result newest"
    return [
        {"name": f"GET /v1/jobs?limit=1, {label}: ms (reply {one_size:,} B)", "value": round(one, 1), "goal": "<= 50"},
        {"name": f"GET /v1/jobs?limit=20, {label}: ms (reply {twenty_size:,} B)", "value": round(twenty, 1),
         "goal": "<= 50"},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=16.8, help="the large result's stored size, about")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print_rows(run(args.mb, args.rounds))


if __name__ == "__main__":
    main()
