"""The real stack the service-level benchmarks run against: an embedded Redis, the workers as
subprocesses (started with ``python -m launcher.cli worker KIND``, as a deployment runs them) and
the API in this process (Flask test client), all on one state directory; and the requests they
send (greedy, distinct prompts of plain token ids)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from domain.infra.heartbeats import alive_workers, statuses
from domain.infra.redis_server import EmbeddedRedis
from domain.settings import Settings
from engine.generation import GenerationRequest
from engine.sampling_params import SamplingParams
from web.app import create_app

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
WORKERS = ("cpu", "gpu", "batches")
BATCH = 16  # ROLLOUT_GPU_BATCH_SIZE's default: the in-process baseline batches like the GPU worker
PROMPT_TOKENS = NEW_TOKENS = 32


def prompt(i: int, length: int = PROMPT_TOKENS) -> list[int]:
    """Token ids >= 100 (below are the demo model's special and media ids), different per job."""
    return [100 + (i * 37 + k * 11) % 500 for k in range(length)]


def job_body(i: int, max_tokens: int = NEW_TOKENS) -> dict:
    return {"token_ids": prompt(i), "sampling_params": {"max_tokens": max_tokens, "temperature": 0,
                                                        "ignore_eos": True}}


def engine_request(i: int, max_tokens: int = NEW_TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt(i), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


class Service:
    """Redis, worker subprocesses and the API's test client, all on one state directory."""

    def __init__(self, state: Path, model_dir: Path, *, admin_key: str | None = None, weights_root: Path | None = None,
                 batch: int | None = BATCH, workers: tuple[str, ...] = WORKERS, **settings):
        """``batch``: the GPU worker's rows (``ROLLOUT_GPU_BATCH_SIZE``); None leaves the default (from the KV pool).
        ``workers``: the kinds started, one process each (a kind twice: two workers); ``settings``:
        more Settings fields, for the API and the workers alike."""
        self.state = state
        self.redis_server = EmbeddedRedis(state / "redis", persistent=False).start()
        self.env = {
            "ROLLOUT_REDIS_URL": self.redis_server.url, "ROLLOUT_MODEL": str(model_dir),
            "ROLLOUT_STATE_DIR": str(state), "ROLLOUT_NODE_ID": "bench-node", "ROLLOUT_TORCH_THREADS": "1",
            "ROLLOUT_LOG_LEVEL": "WARNING", "ROLLOUT_API_KEYS": KEY,
            **{f"ROLLOUT_{name.upper()}": str(value).lower() if isinstance(value, bool) else str(value)
               for name, value in settings.items()},
        }
        self.kinds = workers
        if batch is not None:
            self.env["ROLLOUT_GPU_BATCH_SIZE"] = str(batch)
        if admin_key is not None:
            self.env["ROLLOUT_ADMIN_KEYS"] = admin_key
        if weights_root is not None:
            self.env["ROLLOUT_WEIGHTS_ROOT"] = str(weights_root)
        settings = Settings(redis_url=self.redis_server.url, state_dir=state, model=str(model_dir), api_keys=(KEY,),
                            node_id="bench-node", gpu_batch_size=batch, log_level="WARNING",
                            admin_keys=(admin_key,) if admin_key else (), weights_root=weights_root, **settings)
        try:
            self.app = create_app(settings, self.redis_server.url)
        except BaseException:
            self.redis_server.stop()
            raise
        self.client = self.app.test_client()
        self.svc = self.app.extensions["rollout"]
        self.workers: dict[str, subprocess.Popen] = {}

    def start_workers(self) -> None:
        for i, kind in enumerate(self.kinds):
            name = kind if kind not in self.kinds[:i] else f"{kind}{i}"
            with open(self.state / f"worker-{name}.log", "ab") as log:
                self.workers[name] = subprocess.Popen(
                    [sys.executable, "-m", "launcher.cli", "worker", kind], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, "OMP_NUM_THREADS": "1", **self.env}, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for kind, process in self.workers.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{kind} worker exited:\n{self.log_tail(kind)}")
            alive = alive_workers(self.svc.redis)
            gpus = [s for s in statuses(self.svc.redis, "gpu") if s.get("model_ready")]
            if all(kind in alive for kind in self.kinds) and len(gpus) == self.kinds.count("gpu"):
                return
            time.sleep(0.2)
        raise TimeoutError("workers not ready:\n" + "\n".join(self.log_tail(name) for name in self.workers))

    def log_tail(self, kind: str) -> str:
        return (self.state / f"worker-{kind}.log").read_text(errors="replace")[-3000:]

    def submit(self, body: dict) -> str:
        response = self.client.post("/v1/jobs", json=body, headers=HEADERS)
        assert response.status_code == 202, response.get_json()
        return response.get_json()["id"]

    def submit_many(self, bodies: list[dict]) -> list[str]:
        """The jobs of ``bodies`` in one ``POST /v1/jobs/bulk``, as a trainer sends a rollout step."""
        response = self.client.post("/v1/jobs/bulk", json={"jobs": bodies}, headers=HEADERS)
        assert response.status_code == 202 and not response.get_json()["refused"], response.get_json()
        return [job["id"] for job in response.get_json()["data"]]

    def lookup_ended(self, ids: list[str]) -> list[dict]:
        """The jobs of ``ids`` once all have ended: ``POST /v1/jobs/lookup`` with ``wait``, as a
        trainer follows a step (the Python client's pattern)."""
        while True:
            response = self.client.post("/v1/jobs/lookup", json={"ids": ids, "wait": 60}, headers=HEADERS)
            jobs = response.get_json()["data"]
            if len(jobs) == len(ids) and all(job["status"] in ("succeeded", "failed", "cancelled") for job in jobs):
                return jobs

    def result(self, job_id: str, timeout: float = 120.0) -> dict:
        """Block until the job ends (the job store's wake-up list, as POST /generate waits), then GET it."""
        assert self.svc.jobs.wait(job_id, timeout=timeout) is not None, f"job {job_id} did not end"
        job = self.client.get(f"/v1/jobs/{job_id}", headers=HEADERS).get_json()
        assert job["status"] == "succeeded", job
        return job

    def close_workers(self) -> None:
        for process in self.workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.workers.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def close(self) -> None:
        self.close_workers()
        self.svc.redis.close()
        self.redis_server.stop()


def _die_with_parent() -> None:
    # A benchmark killed without its clean-up must not leave workers behind.
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
