"""What a durable 202 costs at submit (issue #30): ``POST /v1/jobs`` per second with the embedded
Redis' append-only file fsynced once a second (``ROLLOUT_REDIS_FSYNC=everysec``, the default)
and before every answer (``always``), and without the file at all (what ``bench/service.py``
runs on), side by side in one run.

Then the same behind Sentinel (a primary, one replica and three sentinels on loopback,
``LocalFailoverGroup``), answered at once (``ROLLOUT_REDIS_REPLICA_ACKS=0``) and once the replica
holds each job (``1``: Redis ``WAIT``, README "Running Redis for production").

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
    from domain.infra.redis_server import EmbeddedRedis, LocalFailoverGroup
    from domain.settings import Settings
    from engine.demo_model import build_demo_model
    from web.app import create_app

    with tempfile.TemporaryDirectory() as tmp:
        model = build_demo_model(Path(tmp) / "demo")
        rates: dict[str, list[float]] = {"off": [], "everysec": [], "always": [], "sentinel": [], "replica ack": []}
        servers = {policy: EmbeddedRedis(Path(tmp) / f"redis-{policy}", persistent=policy != "off",
                                         fsync="everysec" if policy == "off" else policy).start()
                   for policy in ("off", "everysec", "always")}
        group = LocalFailoverGroup(Path(tmp) / "redis-sentinel").start()
        urls = {**{policy: server.url for policy, server in servers.items()}, "sentinel": group.url,
                "replica ack": group.url}
        try:
            clients = {}
            for policy, url in urls.items():
                settings = Settings(redis_url=url, state_dir=Path(tmp) / f"state-{policy}", model=str(model),
                                    api_keys=(KEY,), max_queued_per_key=20 * jobs, max_queued_total=40 * jobs,
                                    redis_replica_acks=int(policy == "replica ack"), log_level="WARNING")
                clients[policy] = create_app(settings, url).test_client()
                submits_per_second(clients[policy], 20)  # warm up: the model's facts, the scripts
            for _ in range(2):
                for policy, client in clients.items():
                    rates[policy].append(submits_per_second(client, jobs))
        finally:
            for server in servers.values():
                server.stop()
            group.stop()
    off, everysec, always = max(rates["off"]), max(rates["everysec"]), max(rates["always"])
    sentinel, acked = max(rates["sentinel"]), max(rates["replica ack"])
    return [
        {"name": f"submit, POST /v1/jobs per s, no append-only file ({jobs} jobs)", "value": round(off, 1),
         "goal": None},
        {"name": f"submit, POST /v1/jobs per s, appendfsync everysec ({jobs} jobs)", "value": round(everysec, 1),
         "goal": None},
        {"name": f"submit, POST /v1/jobs per s, appendfsync always ({jobs} jobs)", "value": round(always, 1),
         "goal": None},
        {"name": "submit throughput, fsync always / everysec", "value": round(always / everysec, 2), "goal": None},
        {"name": f"submit, POST /v1/jobs per s, behind Sentinel, answered at once ({jobs} jobs)",
         "value": round(sentinel, 1), "goal": None},
        {"name": f"submit, POST /v1/jobs per s, behind Sentinel, once a replica holds the job ({jobs} jobs)",
         "value": round(acked, 1), "goal": None},
        {"name": "submit throughput, replica acknowledged / answered at once", "value": round(acked / sentinel, 2),
         "goal": None},
    ]


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
