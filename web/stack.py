"""``rollout-queue up``: one command that runs the whole service on one machine.

It starts the embedded Redis when no ``ROLLOUT_REDIS_URL`` is given, then the API and one worker of
each kind as child processes (the same commands a multi-node deployment runs separately), waits
until ``/healthz`` says every part is up, and on Ctrl-C or SIGTERM stops every child and Redis.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis
import requests

from engine.errors import ServiceUnavailableError
from workers.models import resolve_model_path
from workers.redis_server import EmbeddedRedis
from workers.settings import Settings, SettingsError

CHILDREN = (("api",), ("worker", "cpu"), ("worker", "gpu"), ("worker", "webhooks"), ("worker", "batches"))
READY_TIMEOUT = 180.0


class RedisUnreachableError(ServiceUnavailableError):
    code = "redis_unreachable"


def run_stack(settings: Settings) -> int:
    _check_port_free(settings.host, settings.port)
    print(f"preparing model {settings.model or '(built-in demo model)'} ...", flush=True)
    model_path = resolve_model_path(settings)
    embedded = None
    redis_url = settings.redis_url
    if redis_url:
        _check_redis(redis_url)
    else:
        embedded = EmbeddedRedis(Path(settings.state_dir) / "redis").start()
        redis_url = embedded.url
        print(f"embedded Redis on {redis_url} (data in {embedded.data_dir})", flush=True)
    if not settings.api_keys:
        print("WARNING: no ROLLOUT_API_KEYS set: the API is OPEN to anyone who can reach it", flush=True)
    env = {**os.environ, "ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_MODEL": model_path}
    children: list[subprocess.Popen] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for command in CHILDREN:
            # A session of their own: Ctrl-C reaches only `up`, which then stops the children in
            # order (workers first, Redis last) instead of everything dying at once.
            children.append(subprocess.Popen([sys.executable, "-m", "web.cli", *command], env=env,
                                             start_new_session=True))
        url = f"http://{settings.host}:{settings.port}"
        if _wait_healthy(url, children, lambda: stopping):
            print(f"\nRollout Queue is up at {url}\n"
                  f"  curl -s {url}/healthz\n"
                  f"  curl -s {url}/v1/generate -H 'Content-Type: application/json' "
                  "-d '{\"prompt\": \"Hello\", \"sampling_params\": {\"max_tokens\": 8, \"temperature\": 0}}'\n"
                  "Ctrl-C stops everything.", flush=True)
        while not stopping and all(child.poll() is None for child in children):
            time.sleep(0.2)
        failed = [c for c in children if c.poll() not in (None, 0)]
        return 1 if failed and not stopping else 0
    finally:
        print("stopping ...", flush=True)
        _stop_children(children)
        if embedded:
            embedded.stop()


def _wait_healthy(url: str, children, stopping) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline and not stopping():
        if any(child.poll() is not None for child in children):
            return False
        try:
            if requests.get(f"{url}/healthz", timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.5)
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
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError:
        raise RedisUnreachableError(f"cannot reach Redis at ROLLOUT_REDIS_URL={url}") from None
    finally:
        client.close()
