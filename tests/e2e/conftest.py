"""The whole stack for end-to-end tests: real Redis, real Celery workers in subprocesses (started
with the same ``rollout-queue worker KIND`` commands a deployment runs), the API in-process, and a
loopback HTTP server that plays media host and webhook receiver.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import db_url
from web.app import create_app
from workers.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
WEBHOOK_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
API_KEY = "e2e-key"
OTHER_KEY = "e2e-other-key"


class LoopbackHost:
    """Serves registered bodies at paths and records every request (method, path, headers, body)."""

    def __init__(self):
        self.routes: dict[str, list] = {}
        self.requests: dict[str, list] = defaultdict(list)
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                host.requests[self.path].append((self.command, dict(self.headers), body))
                responses = host.routes.get(self.path) or [(404, {}, b"")]
                status, headers, payload = responses.pop(0) if len(responses) > 1 else responses[0]
                if callable(payload):
                    time.sleep(payload())
                    payload = b"slow"
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def route(self, path: str, *responses) -> str:
        """Answer ``path`` with the given (status, headers, body) responses in order, the last forever."""
        self.routes[path] = list(responses)
        return self.url(path)


@pytest.fixture(scope="session")
def loopback_host():
    host = LoopbackHost()
    yield host
    host.server.shutdown()


@pytest.fixture(scope="session")
def stack_env(redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    return {
        "ROLLOUT_REDIS_URL": db_url(redis_url, 1),
        "ROLLOUT_MODEL": str(demo_model_dir),
        "ROLLOUT_STATE_DIR": str(tmp_path_factory.mktemp("state")),
        "ROLLOUT_NODE_ID": "e2e-node",
        "ROLLOUT_API_KEYS": f"{API_KEY},{OTHER_KEY}",
        "ROLLOUT_OUTBOUND_ALLOW_NETWORKS": "127.0.0.0/8",
        "ROLLOUT_OUTBOUND_ALLOWED_PORTS": str(loopback_host.port),
        "ROLLOUT_WEBHOOK_SECRETS": WEBHOOK_SECRET,
        "ROLLOUT_WEBHOOK_RETRY_SCHEDULE": "0.2,0.2,0.2,0.2",
        "ROLLOUT_FETCH_TIMEOUT": "3",
        "ROLLOUT_GPU_BATCH_WAIT_MS": "5",
        "ROLLOUT_TORCH_THREADS": "1",
        "ROLLOUT_SHM_POOL_BYTES": str(256 * 1024 * 1024),
        "ROLLOUT_LOG_LEVEL": "WARNING",
    }


def _start_worker(kind: str, env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"worker-{kind}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "web.cli", "worker", kind],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=log, stderr=subprocess.STDOUT,
    )


class Stack:
    def __init__(self, env, app, log_dir, loopback):
        self.env = env
        self.app = app
        self.client = app.test_client()
        self.services = app.extensions["rollout"]
        self.log_dir = log_dir
        self.host = loopback
        self.workers: dict[str, subprocess.Popen] = {}

    def start(self, kind: str) -> None:
        self.workers[kind] = _start_worker(kind, self.env, self.log_dir)

    def kill(self, kind: str) -> None:
        process = self.workers[kind]
        process.kill()
        process.wait()

    def wait_ready(self, kinds, timeout: float = 120.0) -> None:
        from workers.heartbeats import alive_workers

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = alive_workers(self.services.redis)
            if all(kind in alive for kind in kinds) and ("gpu" not in kinds or alive["gpu"].get("model_ready")):
                return
            for kind, process in self.workers.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{kind} worker exited; see {self.log_dir}/worker-{kind}.log")
            time.sleep(0.2)
        raise TimeoutError(f"workers not ready; logs in {self.log_dir}")

    def headers(self, key: str = API_KEY) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def submit(self, body: dict, key: str = API_KEY) -> dict:
        response = self.client.post("/v1/jobs", json=body, headers=self.headers(key))
        assert response.status_code == 202, response.get_json()
        return response.get_json()

    def wait(self, job_id: str, timeout: float = 60.0, key: str = API_KEY) -> dict:
        job = self.services.jobs.wait(job_id, timeout=timeout)
        assert job is not None, f"job {job_id} did not finish in {timeout}s: {self.services.jobs.get(job_id)}"
        return self.client.get(f"/v1/jobs/{job_id}", headers=self.headers(key)).get_json()


@pytest.fixture(scope="session")
def stack(stack_env, loopback_host, tmp_path_factory):
    """Every worker kind running against one Redis; the API in-process with the same settings."""
    saved = dict(os.environ)
    os.environ.update(stack_env)
    try:
        settings = load_settings()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    app = create_app(settings, stack_env["ROLLOUT_REDIS_URL"])
    log_dir = Path(os.environ.get("ROLLOUT_TEST_LOG_DIR") or tmp_path_factory.mktemp("logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(stack_env, app, log_dir, loopback_host)
    for kind in ("cpu", "gpu", "webhooks", "batches"):
        stack.start(kind)
    try:
        stack.wait_ready(("cpu", "gpu", "webhooks", "batches"))
        yield stack
    finally:
        for process in stack.workers.values():
            process.terminate()
        for process in stack.workers.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
