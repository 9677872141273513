"""The whole stack for end-to-end tests: real Redis, real Celery workers in subprocesses (running
the entry point of the ``rollout-queue worker KIND`` commands a deployment runs, forked from a
process that has already imported what workers import: ``tests/worker_forks.py``), the API
in-process, and a loopback HTTP server that plays media host and webhook receiver.

The session ``stack`` fixture is shared by tests that leave it as they found it. A test module that
kills, restarts or reconfigures parts builds its own with :func:`make_stack_env` and
:func:`build_stack` (its own Redis and workers), so the shared stack is never disturbed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from domain.settings import load_settings
from tests.conftest import empty_db_url
from tests.worker_forks import start_worker
from web.app import create_app

ROOT = Path(__file__).resolve().parents[2]
WEBHOOK_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
API_KEY = "e2e-key"
OTHER_KEY = "e2e-other-key"
ALL_KINDS = ("cpu", "gpu", "webhooks", "batches")


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
                status, headers, payload, *delay = responses.pop(0) if len(responses) > 1 else responses[0]
                if delay:  # a slow host: (status, headers, body, seconds before answering)
                    time.sleep(delay[0])
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
        """Answer ``path`` with the given (status, headers, body[, delay_s]) responses in order, the
        last forever."""
        self.routes[path] = list(responses)
        return self.url(path)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="session")
def loopback_host():
    host = LoopbackHost()
    yield host
    host.close()


def make_stack_env(*, redis_url: str, model_dir, state_dir, loopback: LoopbackHost, node_id: str = "e2e-node",
                   **overrides: str) -> dict[str, str]:
    """The ``ROLLOUT_*`` environment of a test stack; ``overrides`` are more variables (full names)."""
    return {
        "ROLLOUT_REDIS_URL": redis_url,
        "ROLLOUT_MODEL": str(model_dir),
        "ROLLOUT_STATE_DIR": str(state_dir),
        "ROLLOUT_NODE_ID": node_id,
        "ROLLOUT_API_KEYS": f"{API_KEY},{OTHER_KEY}",
        "ROLLOUT_OUTBOUND_ALLOW_NETWORKS": "127.0.0.0/8",
        "ROLLOUT_OUTBOUND_ALLOWED_PORTS": str(loopback.port),
        "ROLLOUT_WEBHOOK_SECRETS": WEBHOOK_SECRET,
        "ROLLOUT_WEBHOOK_RETRY_SCHEDULE": "0.2,0.2,0.2,0.2",
        "ROLLOUT_FETCH_TIMEOUT": "3",
        "ROLLOUT_GPU_BATCH_WAIT_MS": "5",
        "ROLLOUT_TORCH_THREADS": "1",
        "ROLLOUT_SHM_POOL_BYTES": str(256 * 1024 * 1024),
        "ROLLOUT_LOG_LEVEL": "WARNING",
        "ROLLOUT_CPU_CONCURRENCY": "4",  # what the tests' fair shares are sized for, on any machine
        **overrides,
    }


@pytest.fixture(scope="session")
def stack_env(redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    # A database of its own (tests/conftest.py's db_url): its GPU worker keeps reporting in the
    # background, and tests on db 0 that ran after it in the same session saw a second worker.
    return make_stack_env(redis_url=empty_db_url(redis_url, 1), model_dir=demo_model_dir,
                          state_dir=tmp_path_factory.mktemp("state"), loopback=loopback_host)


def settings_from_env(env: dict[str, str]):
    """Settings parsed from ``env`` exactly as a worker parses them (the process env is restored)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return load_settings()
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Stack:
    """Worker subprocesses by name (``cpu``, ``gpu``, ... or any name with a ``kind``), the API
    in-process (``client``) and the services it uses (``services.redis``, ``services.jobs``)."""

    def __init__(self, env, app, log_dir, loopback):
        self.env = env
        self.app = app
        self.client = app.test_client()
        self.services = app.extensions["rollout"]
        self.log_dir = Path(log_dir)
        self.host = loopback
        self.workers: dict[str, subprocess.Popen] = {}
        self.kinds: dict[str, str] = {}
        self.worker_env: dict[str, dict[str, str]] = {}

    def start(self, name: str, kind: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start worker ``name`` (of ``kind``, default the name) with ``env`` on top of the stack's."""
        kind = kind or name
        if env is not None:
            self.worker_env[name] = env
        worker_env = {**self.env, **self.worker_env.get(name, {})}
        process = start_worker(kind, {**os.environ, "OMP_NUM_THREADS": "1", **worker_env},
                               self.log_dir / f"worker-{name}.log")
        self.workers[name] = process
        self.kinds[name] = kind
        return process

    def kill(self, name: str) -> None:
        """SIGKILL the worker's main process (what ``kill -9 PID`` does) and reap it."""
        process = self.workers[name]
        process.kill()
        process.wait()

    def pause(self, name: str) -> None:
        """SIGSTOP the worker and its pool processes: what a GC pause, swap storm or frozen VM
        looks like from outside (its heartbeat lapses, its sockets stay open)."""
        for pid in _process_tree(self.workers[name].pid):
            os.kill(pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        """SIGCONT what ``pause`` stopped: the worker goes on from where it was."""
        for pid in _process_tree(self.workers[name].pid):
            os.kill(pid, signal.SIGCONT)

    def stop(self, name: str, timeout: float = 15.0) -> None:
        """Stop the worker gracefully (SIGTERM: Celery's warm shutdown), SIGKILL if it hangs."""
        _stop([self.workers[name]], timeout)

    def restart(self, name: str) -> subprocess.Popen:
        if self.workers[name].poll() is None:
            self.stop(name)
        return self.start(name, self.kinds[name])

    def heartbeat(self, name: str) -> dict | None:
        """The live heartbeat of this very worker process (a dead one's may linger for its TTL)."""
        from domain.infra.heartbeats import live

        suffix = f"-{self.workers[name].pid}"
        return next((status for key, status in live(self.services.redis, (self.kinds[name],)).items()
                     if key.endswith(suffix)), None)

    def wait_ready(self, names=None, timeout: float = 120.0) -> None:
        """Wait until each named worker process (default: all) beats; a GPU worker once its model is ready."""
        names = list(self.workers) if names is None else list(names)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = []
            for name in names:
                if self.workers[name].poll() is not None:
                    raise RuntimeError(f"{name} worker exited; see {self.log_dir}/worker-{name}.log")
                beat = self.heartbeat(name)
                if beat is None or (self.kinds[name] == "gpu" and not beat.get("model_ready")):
                    pending.append(name)
            if not pending:
                return
            time.sleep(0.2)
        raise TimeoutError(f"workers {pending} not ready; logs in {self.log_dir}")

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

    def close(self) -> None:
        _stop([p for p in self.workers.values()], timeout=10.0)
        self.services.redis.close()


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc), parents first."""
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").glob("*"):
            try:
                tree.extend(int(child) for child in (task / "children").read_text().split())
            except OSError:
                pass  # the task ended meanwhile
        i += 1
    return tree


def _stop(processes: list[subprocess.Popen], timeout: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def build_stack(env: dict[str, str], loopback: LoopbackHost, log_dir, workers=ALL_KINDS, timeout: float = 120.0):
    """A stack on ``env`` with ``workers`` started (names, or (name, kind, env) tuples) and ready;
    every worker it still runs is stopped on exit."""
    app = create_app(settings_from_env(env), env["ROLLOUT_REDIS_URL"])
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    stack = Stack(env, app, log_dir, loopback)
    try:
        for spec in workers:
            name, kind, extra = (spec, None, None) if isinstance(spec, str) else spec
            stack.start(name, kind, extra)
        stack.wait_ready(timeout=timeout)
        yield stack
    finally:
        stack.close()


def log_dir_for(tmp_path_factory, name: str) -> Path:
    """Where a stack's worker logs go: under ROLLOUT_TEST_LOG_DIR when set (kept), else a tmp dir."""
    root = os.environ.get("ROLLOUT_TEST_LOG_DIR")
    return Path(root) / name if root else tmp_path_factory.mktemp(name)


@pytest.fixture(scope="session")
def stack(stack_env, loopback_host, tmp_path_factory):
    """Every worker kind running against one Redis; the API in-process with the same settings."""
    root = os.environ.get("ROLLOUT_TEST_LOG_DIR")
    log_dir = Path(root) if root else tmp_path_factory.mktemp("logs")
    with build_stack(stack_env, loopback_host, log_dir) as shared:
        yield shared
