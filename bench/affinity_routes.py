"""What the GPU affinity route map holds in Redis per prompt routed (issue #56, item 6).

``domain.infra.gpu_affinity.GpuRouter`` on an embedded Redis with four GPU workers (heartbeats as
the GPU worker writes them): distinct prompts of 2,000 and of 8,000 tokens, one placement a call as
jobs arrive. Reported per prompt: the route keys it added and Redis's ``used_memory`` growth, and
the same at the queue caps (``ROLLOUT_MAX_QUEUED_PER_KEY``, ``ROLLOUT_MAX_QUEUED_TOTAL`` prompts of
8,000 tokens within the routes' lifetime). A route lives ``ROUTE_TTL_S``; nothing here waits for it to lapse.

Run: ``python -m bench.affinity_routes [--prompts 400]`` from the repository root (~10 s).
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import redis

from bench.rows import print_rows
from domain.infra.gpu_affinity import GpuRouter, Placement, register_direct_queue
from domain.infra.heartbeats import beat
from domain.infra.redis_server import EmbeddedRedis
from domain.names import direct_queue
from domain.settings import Settings


def _per_prompt(client: redis.Redis, tokens: int, prompts: int) -> tuple[float, float]:
    """Route keys and bytes of Redis memory added per distinct prompt of ``tokens`` tokens."""
    client.flushdb()
    for pid in range(4):
        name = f"bench-node-{pid}"
        register_direct_queue(client, name)
        beat(client, "gpu", name, {"model_ready": True, "node": "bench-node", "direct_queue": direct_queue(name),
                                   "held": []}, ttl=600)
    router, rnd = GpuRouter(client), random.Random(tokens)
    keys_before, memory_before = client.dbsize(), client.info("memory")["used_memory"]
    for i in range(prompts):
        router.queues([Placement(f"job_{i}", [rnd.randrange(150_000) for _ in range(tokens)], "bench-scope")])
    return ((client.dbsize() - keys_before) / prompts,
            (client.info("memory")["used_memory"] - memory_before) / prompts)


def run(prompts: int = 400) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="rq-bench-affinity-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", persistent=False).start()
        try:
            client = redis.Redis.from_url(server.url)
            short = _per_prompt(client, 2_000, prompts)
            long = _per_prompt(client, 8_000, prompts)
        finally:
            server.stop()
    settings = Settings()
    return [
        {"name": "route keys per 2,000-token prompt", "value": round(short[0], 1), "goal": None},
        {"name": "· Redis bytes per 2,000-token prompt", "value": round(short[1]), "goal": None},
        {"name": "route keys per 8,000-token prompt", "value": round(long[0], 1), "goal": None},
        {"name": "· Redis bytes per 8,000-token prompt", "value": round(long[1]), "goal": None},
    ] + [{"name": f"route map at {name} ({cap:,} prompts of 8,000 tokens), MB", "value": round(long[1] * cap / 1e6),
          "goal": None}
         for name, cap in (("one key's queue cap", settings.max_queued_per_key),
                           ("the queue cap", settings.max_queued_total))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=400)
    args = parser.parse_args()
    print_rows(run(args.prompts))


if __name__ == "__main__":
    main()
