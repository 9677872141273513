"""Feature transport on one node: a handle through Redis vs the bytes through Redis (bench/README.md).

Two unrelated processes (a producer and a consumer, each its own interpreter) and a real
redis-server. For each size, side by side in one run:

- bytes:    producer SETs the safetensors bytes, consumer GETs and deserializes them;
- shm:      producer wraps into its shared-memory pool and pushes the handle, consumer opens
            (``open_feature``: copies out) and acknowledges;
- shm_held: the same, but the consumer uses the feature while held (``opened``: a zero-copy
            view, acknowledged when the block ends), as a worker that holds features for a batch;
- cuda_ipc: (CUDA only) the same through the producer's CUDA pool.

Each figure is the median round trip seen by the producer (send, consumer done, reply back),
the paths interleaved so each sees the same load; the consumer's open alone is reported too
(for cuda_ipc: the cached open of an already-mapped pool).
Goal: handle / bytes <= 0.1. ``python bench/transport.py`` prints the table; ``run()`` returns
the rows (name, value, goal, unit) for a collecting runner.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Runnable as a plain script: then sys.path[0] is bench/, whose modules (bench/engine.py) would
# shadow the project's packages, so the project root takes its place.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES_MIB = (5, 22)
REPEATS = 21
WARMUP = 3
GOAL = 0.1
_QUEUE = "rq:bench:transport:messages"
_DONE = "rq:bench:transport:done"
_BLOB = "rq:bench:transport:blob"


def run(sizes_mib: tuple[int, ...] = SIZES_MIB, repeats: int = REPEATS) -> list[dict]:
    """Measure every path and return rows {name, value, goal, unit}."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with _redis_server() as url:
        consumer = subprocess.Popen([sys.executable, __file__, "--role", "consumer", url], env=env)
        try:
            producer = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "producer",
                    url,
                    "--sizes",
                    ",".join(map(str, sizes_mib)),
                    "--repeats",
                    str(repeats),
                ],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                check=True,
                timeout=300,
            )
            consumer.wait(30)
        finally:
            if consumer.poll() is None:
                consumer.kill()
                consumer.wait()
    results = json.loads(producer.stdout.strip().splitlines()[-1])
    return _rows(results, sizes_mib)


def _rows(results: dict, sizes_mib: tuple[int, ...]) -> list[dict]:
    rows = []
    for mib in sizes_mib:
        bytes_ms = results[f"bytes/{mib}"]["round_trip_ms"]
        rows.append(_row(f"transport.bytes_via_redis.{mib}MiB", bytes_ms, None, "ms"))
        for kind in ("shm", "shm_held", "cuda_ipc"):
            measured = results.get(f"{kind}/{mib}")
            if measured is None:
                continue
            rows.append(_row(f"transport.{kind}_handle.{mib}MiB", measured["round_trip_ms"], None, "ms"))
            # The consumer's open alone (for cuda_ipc: of an already-mapped pool).
            rows.append(_row(f"transport.{kind}_open.{mib}MiB", measured["open_ms"], None, "ms"))
            rows.append(
                _row(
                    f"transport.{kind}_over_bytes.{mib}MiB",
                    measured["round_trip_ms"] / bytes_ms,
                    f"<= {GOAL}",
                    "ratio",
                )
            )
    return rows


def _row(name: str, value: float, goal: str | None, unit: str) -> dict:
    return {"name": name, "value": round(value, 4), "goal": goal, "unit": unit}


@contextlib.contextmanager
def _redis_server():
    import tempfile

    from domain.infra.redis_server import EmbeddedRedis

    with tempfile.TemporaryDirectory() as data, EmbeddedRedis(data, persistent=False) as server:
        yield server.url


# --- the two roles, each in its own process ---------------------------------------------------


def _producer(url: str, sizes_mib: list[int], repeats: int) -> None:
    import redis
    import torch
    from safetensors.torch import save

    from domain.infra.transport_acks import RedisAckChannel
    from engine.transport import CudaIpcPool, ShmPool

    torch.set_num_threads(1)
    client = redis.Redis.from_url(url)
    acks = RedisAckChannel(client)
    pools = {"shm": ShmPool(acks, capacity_bytes=128 << 20)}
    if torch.cuda.is_available():
        pools["cuda_ipc"] = CudaIpcPool(acks, capacity_bytes=128 << 20)

    def round_trip(send) -> tuple[float, float]:
        start = time.perf_counter()
        send()
        done = json.loads(client.blpop([_DONE], timeout=60)[1])
        return (time.perf_counter() - start) * 1e3, done["open_ms"]

    def send_bytes(x):
        client.set(_BLOB, save({"t": x}))
        client.rpush(_QUEUE, json.dumps({"mode": "bytes"}))

    def send_handle(pool, x, mode="handle"):
        client.rpush(_QUEUE, json.dumps({"mode": mode, "handle": pool.wrap(x).handle}))

    results = {}
    try:
        for mib in sizes_mib:
            x = torch.randn((mib << 20) // 4)
            paths = {"bytes": lambda x=x: send_bytes(x)}
            for kind, pool in pools.items():
                paths[kind] = lambda x=x, pool=pool: send_handle(pool, x)
            paths["shm_held"] = lambda x=x: send_handle(pools["shm"], x, "held")
            samples = {name: [] for name in paths}
            # Interleaved, so every path sees the same machine load (2 shared cores).
            for i in range(WARMUP + repeats):
                for name, send in paths.items():
                    measured = round_trip(send)
                    if i >= WARMUP:
                        samples[name].append(measured)
            for name, pairs in samples.items():
                results[f"{name}/{mib}"] = {
                    "round_trip_ms": statistics.median(rt for rt, _ in pairs),
                    "open_ms": statistics.median(op for _, op in pairs),
                }
    finally:
        client.rpush(_QUEUE, json.dumps({"mode": "stop"}))
        for pool in pools.values():
            pool.close()
    print(json.dumps(results))


def _consumer(url: str) -> None:
    import redis
    import torch
    from safetensors.torch import load

    from domain.infra.transport_acks import RedisAckChannel
    from engine.transport import acknowledge, close_consumer_mappings, open_feature, opened

    torch.set_num_threads(1)
    client = redis.Redis.from_url(url)
    acks = RedisAckChannel(client)
    while True:
        message = json.loads(client.blpop([_QUEUE])[1])
        if message["mode"] == "stop":
            close_consumer_mappings()
            return
        start = time.perf_counter()
        if message["mode"] == "bytes":
            tensor = load(client.get(_BLOB))["t"]
            open_ms = (time.perf_counter() - start) * 1e3
        elif message["mode"] == "held":
            with opened(acks, [message["handle"]]) as [tensor]:
                open_ms = (time.perf_counter() - start) * 1e3
        else:
            tensor = open_feature(message["handle"])
            open_ms = (time.perf_counter() - start) * 1e3
            acknowledge(acks, [message["handle"]])
        del tensor
        client.rpush(_DONE, json.dumps({"open_ms": open_ms}))


def _print_table(rows: list[dict]) -> None:
    print(f"{'figure':<44} {'value':>10}  goal")
    for row in rows:
        value = f"{row['value']:.3f}" if row["unit"] == "ratio" else f"{row['value']:.2f} ms"
        print(f"{row['name']:<44} {value:>10}  {row['goal'] or ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["producer", "consumer"])
    parser.add_argument("url", nargs="?")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)))
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args()
    if args.role == "producer":
        _producer(args.url, [int(s) for s in args.sizes.split(",")], args.repeats)
    elif args.role == "consumer":
        _consumer(args.url)
    else:
        _print_table(run(tuple(int(s) for s in args.sizes.split(",")), args.repeats))


if __name__ == "__main__":
    main()
