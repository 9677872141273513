"""A producer/consumer process for the transport tests: ``python agent.py REDIS_URL NAME``.

It serves JSON commands from the Redis list ``rqt-test:NAME:cmd`` and answers on
``rqt-test:NAME:reply``, so the tests exchange handles between unrelated processes through
Redis only (no fork, no inherited state).
"""

from __future__ import annotations

import json
import os
import sys
import time
from multiprocessing import resource_tracker

import redis
import torch
from transport_support import digest, make_tensor

from domain.infra.transport_acks import RedisAckChannel
from engine.errors import RolloutError
from engine.transport import acknowledge, make_transport, open_feature, sweep_orphaned_segments


class Agent:
    def __init__(self, client: redis.Redis):
        self.redis = client
        self.acks = RedisAckChannel(client)
        self.pool = None

    def info(self):
        tracker = resource_tracker._resource_tracker  # test-only peek at the tracker's pid
        return {"pid": os.getpid(), "tracker_pid": tracker._pid}

    def pool_(self, kind, **options):
        if self.pool is not None:
            self.pool.close()
        self.pool = make_transport(kind, acks=self.acks, **options)
        return {
            "pool_id": getattr(self.pool, "pool_id", None),
            "segment": getattr(self.pool, "segment_name", None),
        }

    def produce(self, queue, specs):
        kinds = []
        for spec in specs:
            wrapped = self.pool.wrap(make_tensor(spec))
            kinds.append(wrapped.kind)
            self.redis.rpush(queue, json.dumps(wrapped.handle))
        return {"kinds": kinds}

    def consume(self, queue, count, ack=True, device=None, timeout=60):
        results = []
        for _ in range(count):
            got = self.redis.blpop([queue], timeout=timeout)
            if got is None:
                raise TimeoutError(f"no handle on {queue}")
            results.append(self._open(json.loads(got[1]), ack, device))
        return results

    def open(self, handles, ack=True, device=None):
        return [self._open(h, ack, device) for h in handles]

    def _open(self, handle, ack, device):
        start = time.perf_counter()
        try:
            tensor = open_feature(handle, device=device)
        except RolloutError as exc:
            return {"error": exc.code}
        open_ms = (time.perf_counter() - start) * 1e3
        result = {
            "digest": digest(tensor),
            "open_ms": open_ms,
            "kind": handle["kind"],
            "device": str(tensor.device),
        }
        del tensor
        if ack:
            acknowledge(self.acks, [handle])
        return result

    def stats(self):
        return self.pool.stats() if hasattr(self.pool, "stats") else {}

    def reap(self):
        return self.pool.reap()

    def close(self):
        self.pool.close()
        return True

    def sweep(self):
        return sweep_orphaned_segments()


def main(url: str, name: str) -> None:
    torch.set_num_threads(1)
    client = redis.Redis.from_url(url)
    agent = Agent(client)
    ops = {
        "info": agent.info,
        "pool": agent.pool_,
        "produce": agent.produce,
        "consume": agent.consume,
        "open": agent.open,
        "stats": agent.stats,
        "reap": agent.reap,
        "close": agent.close,
        "sweep": agent.sweep,
    }
    reply_key, cmd_key = f"rqt-test:{name}:reply", f"rqt-test:{name}:cmd"
    client.rpush(reply_key, json.dumps({"ok": agent.info()}))
    while True:
        _, raw = client.blpop([cmd_key])
        command = json.loads(raw)
        op = command.pop("op")
        if op == "exit":
            break
        try:
            answer = {"ok": ops[op](**command)}
        except Exception as exc:  # reported to the test, which fails with it
            answer = {
                "error": {"type": type(exc).__name__, "code": getattr(exc, "code", None), "message": str(exc)}
            }
        client.rpush(reply_key, json.dumps(answer))
    if agent.pool is not None:
        agent.pool.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
