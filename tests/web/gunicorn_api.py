"""``rollout-queue api`` (gunicorn) as deployed, on a free loopback port, for the tests that must
speak to it over real sockets (chunked bodies, malformed request lines, long-lived streams)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

from domain.infra.redis_server import free_port
from tests.web.conftest import KEY_A

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def gunicorn_api(redis_url: str, model_dir, state_dir: Path, **settings: str) -> Iterator[tuple[str, int]]:
    """The API with ``ROLLOUT_<NAME>`` settings (plus the model, state and one key); yields its URL
    and port, then stops it and checks its log holds no traceback."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update({"ROLLOUT_REDIS_URL": redis_url, "ROLLOUT_MODEL": str(model_dir), "ROLLOUT_STATE_DIR": str(state_dir),
                "ROLLOUT_API_KEYS": KEY_A, "ROLLOUT_PORT": str(port), "ROLLOUT_API_WORKERS": "1",
                "ROLLOUT_LOG_LEVEL": "WARNING"})
    env.update({f"ROLLOUT_{name.upper()}": value for name, value in settings.items()})
    log = state_dir / "api.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "launcher.cli", "api"], cwd=ROOT, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            try:
                requests.get(f"{url}/openapi.json", timeout=10)
                break
            except requests.RequestException:  # not listening yet, or the first request still loading
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield url, port
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "Traceback" not in log.read_text()
