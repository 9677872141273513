"""What a durable 202 costs at submit (issue #30): ``POST /v1/jobs`` per second with the embedded
Redis' append-only file fsynced once a second (``ROLLOUT_REDIS_FSYNC=everysec``, the default)
and before every answer (``always``), and without the file at all (what ``bench/service.py``
runs on), side by side in one run.

The API in-process (Flask's test client, as ``bench/service.py`` measures submit throughput), no
workers, one persistent embedded Redis per policy on the same disk; each policy submits the same
jobs, alternating twice, and the faster round counts.

Run: ``python -m bench.durability`` from the repository root.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.rows import print_rows  # noqa: E402

KEY = "bench-key"
JOBS = 500
BODY = {"token_ids": list(range(100, 132)), "sampling_params": {"max_tokens": 32, "temperature": 0}}


def submits_per_second(client, jobs: int) -> float:
    headers = {"Authorization": f"Bearer {KEY}"}
    started = time.perf_counter()
    for _ in range(jobs):
        response = client.post("/v1/jobs", json=BODY, headers=headers)
        assert response.status_code == 202, response.get_json()
    return jobs / (time.perf_counter() - started)


def run(jobs: int = JOBS) -> list[dict]:
    from engine.demo_model import build_demo_model
    from web.app import create_app
    from workers.infra.redis_server import EmbeddedRedis
    from workers.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        model = build_demo_model(Path(tmp) / "demo")
        rates: dict[str, list[float]] = {"off": [], "everysec": [], "always": []}
        servers = {policy: EmbeddedRedis(Path(tmp) / f"redis-{policy}", persistent=policy != "off",
                                         fsync="everysec" if policy == "off" else policy).start()
                   for policy in rates}
        try:
            clients = {}
            for policy, server in servers.items():
                settings = Settings(redis_url=server.url, state_dir=Path(tmp) / f"state-{policy}", model=str(model),
                                    api_keys=(KEY,), max_queued_per_key=10 * jobs, log_level="WARNING")
                clients[policy] = create_app(settings, server.url).test_client()
                submits_per_second(clients[policy], 20)  # warm up: the model's facts, the scripts
            for _ in range(2):
                for policy, client in clients.items():
                    rates[policy].append(submits_per_second(client, jobs))
        finally:
            for server in servers.values():
                server.stop()
    off, everysec, always = max(rates["off"]), max(rates["everysec"]), max(rates["always"])
    return [
        {"name": f"submit, POST /v1/jobs per s, no append-only file ({jobs} jobs)", "value": round(off, 1),
         "goal": None},
        {"name": f"submit, POST /v1/jobs per s, appendfsync everysec ({jobs} jobs)", "value": round(everysec, 1),
         "goal": None},
        {"name": f"submit, POST /v1/jobs per s, appendfsync always ({jobs} jobs)", "value": round(always, 1),
         "goal": None},
        {"name": "submit throughput, fsync always / everysec", "value": round(always / everysec, 2), "goal": None},
    ]


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
