"""``rollout-queue up``: one command that runs the whole service on one machine.

It starts the embedded Redis when no ``ROLLOUT_REDIS_URL`` is given, then the API and one worker of
each kind as child processes (the same commands a multi-node deployment runs separately), and
says when ``/healthz`` reports every part up. A child that dies is started again with backoff
(launcher/supervisor.py); only Ctrl-C or SIGTERM stops every child, then Redis.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis
import requests

from domain.infra.redis_client import connect
from domain.infra.redis_memory import HIGH_WATER, default_maxmemory_bytes
from domain.infra.redis_server import EmbeddedRedis, LocalFailoverGroup
from domain.models import resolve_model_path
from domain.settings import Settings, SettingsError
from engine.errors import ServiceUnavailableError
from launcher.supervisor import Child, Supervisor, process_child

CHILDREN = (("api",), ("worker", "cpu"), ("worker", "gpu"), ("worker", "webhooks"), ("worker", "batches"))
READY_TIMEOUT = 180.0


class RedisUnreachableError(ServiceUnavailableError):
    code = "redis_unreachable"


def child_env(settings: Settings, *, redis_url: str, model_path: str) -> dict[str, str]:
    """The environment ``up`` starts its children with: the Redis and the model it prepared."""
    # The URL names a Sentinel target too (domain/redis_target.py): it replaces the sentinels' settings.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_REDIS_SENTINEL")},
           "ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_MODEL": model_path}
    if not settings.model and not settings.served_model_name:
        # The children get the built demo model's path; clients still name it by the demo's name.
        env["ROLLOUT_SERVED_MODEL_NAME"] = settings.demo_model
    return env


def embedded_maxmemory(settings: Settings) -> int:
    """The embedded Redis' bound: ROLLOUT_REDIS_MAXMEMORY_BYTES, or a share of this machine's memory."""
    if settings.redis_maxmemory_bytes is not None:
        return settings.redis_maxmemory_bytes
    return default_maxmemory_bytes()


def _bound(maxmemory: int) -> str:
    if not maxmemory:
        return "no maxmemory (ROLLOUT_REDIS_MAXMEMORY_BYTES=0)"
    return f"maxmemory {maxmemory / 2**20:.0f} MiB, new work refused above {HIGH_WATER:.0%} of it"


def run_stack(settings: Settings) -> int:
    _check_port_free(settings.host, settings.port)
    print(f"preparing model {settings.model or '(built-in demo model)'} ...", flush=True)
    model_path = resolve_model_path(settings)
    embedded = None
    redis_url = settings.redis_target
    if redis_url:
        _check_redis(redis_url)
    elif settings.embedded_redis == "sentinel":
        embedded = LocalFailoverGroup(Path(settings.state_dir) / "redis-sentinel", fsync=settings.redis_fsync,
                                      replicas=settings.embedded_redis_replicas,
                                      maxmemory=embedded_maxmemory(settings)).start()
        redis_url = embedded.url
        print(f"embedded Redis: primary on port {embedded.primary.port}, replicas on "
              f"{', '.join(str(r.port) for r in embedded.replicas)}, "
              f"sentinels on {', '.join(str(s.port) for s in embedded.sentinels)}; "
              f"{_bound(embedded.primary.maxmemory)}", flush=True)
    else:
        embedded = EmbeddedRedis(Path(settings.state_dir) / "redis", fsync=settings.redis_fsync,
                                 maxmemory=embedded_maxmemory(settings)).start()
        redis_url = embedded.url
        print(f"embedded Redis on {redis_url} (data in {embedded.data_dir}); {_bound(embedded.maxmemory)}",
              flush=True)
    if not settings.api_keys:
        print("WARNING: no ROLLOUT_API_KEYS set: the API is OPEN to anyone who can reach it", flush=True)
    env = child_env(settings, redis_url=redis_url, model_path=model_path)
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    children: list[Callable[[], subprocess.Popen | None]] = []
    supervised: list[Child] = []
    # Restarted on the same port and append-only file: the workers reconnect by themselves. A
    # Sentinel group's data server restarts in the role the sentinels give it now (LocalFailoverGroup.restart).
    if isinstance(embedded, LocalFailoverGroup):
        members = [(name, member, lambda m=member: embedded.start_member(m)) for name, member in embedded.members]
    else:
        members = [("redis", embedded, embedded.start)] if embedded else []
    for name, member, start in members:
        supervised.append(Child(name, start, lambda m=member: m.running, lambda m=member: m.pid))
    for command in CHILDREN:
        child, current = process_child(" ".join(command), _spawner(command, env))
        supervised.append(child)
        children.append(current)
    supervisor = Supervisor(supervised)
    try:
        supervisor.start_all()
        url = f"http://{settings.host}:{settings.port}"
        healthy, deadline, next_check = False, time.monotonic() + READY_TIMEOUT, 0.0
        while not stopping:
            supervisor.tick()
            now = time.monotonic()
            if not healthy and now >= next_check:
                healthy, next_check = _healthy(url), now + 0.5
                if healthy:
                    print(f"\nRollout Queue is up at {url}\n"
                          f"  curl -s {url}/healthz\n"
                          f"  curl -s {url}/v1/generate -H 'Content-Type: application/json' "
                          "-d '{\"prompt\": \"Hello\", \"sampling_params\": {\"max_tokens\": 8, \"temperature\": 0}}'\n"
                          "Ctrl-C stops everything.", flush=True)
                elif now > deadline:
                    deadline = float("inf")
                    print(f"not healthy after {READY_TIMEOUT:.0f} s; still trying (see {url}/healthz)", flush=True)
            time.sleep(0.2)
        return 0
    finally:
        print("stopping ...", flush=True)
        _stop_children([p for p in (current() for current in children) if p is not None])
        if embedded:
            embedded.stop()


def _spawner(command: tuple[str, ...], env: dict[str, str]) -> Callable[[], subprocess.Popen]:
    def spawn() -> subprocess.Popen:
        # A session of their own: Ctrl-C reaches only `up`, which then stops the children in
        # order (workers first, Redis last) instead of everything dying at once.
        return subprocess.Popen([sys.executable, "-m", "launcher.cli", *command], env=env, start_new_session=True)

    return spawn


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/healthz", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _stop_children(children: list[subprocess.Popen], timeout: float = 15.0) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            raise SettingsError(f"port {port} on {host} is in use: set ROLLOUT_PORT to another port") from None


def _check_redis(url: str) -> None:
    client = connect(url)
    try:
        client.ping()
    except redis.RedisError:
        raise RedisUnreachableError(f"cannot reach Redis at {url}") from None
    finally:
        client.close()
