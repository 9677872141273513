"""Soak: 2,000 image jobs through the service as ``rollout-queue up`` runs it, then look for leaks.

Run with ``python -m pytest tests/stress -m stress -q -s`` (excluded from the default run). The
service runs as a subprocess with its own state directory, embedded Redis and port, the demo model
and the multimodal cache on. Jobs carry small images as data: URLs, half of them drawn from a few
repeated images (cache hits) and half unique; two sizes, so features travel both as shared-memory
handles and inline. Checks: every job ends ``succeeded`` (none lost, none stuck), the cache was hit,
and after a warm-up the worker processes' anonymous memory and their /dev/shm segments stay flat.
Everything has a deadline: the test ends by itself within about ten minutes.

Bounded caches grow until they are full, and that is not a leak: each CPU worker keeps the features
it used last in memory (``MultimodalCache``'s local tier, 256 MiB). Before the warm-up a few large
unique images fill that tier, so that afterwards it only evicts and replaces; whatever still grows
then is per-job memory that is never given back.
"""

from __future__ import annotations

import base64
import inspect
import io
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
from PIL import Image

from domain.infra.redis_server import free_port
from processors.cache import MultimodalCache

pytestmark = [pytest.mark.stress, pytest.mark.timeout(660)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "soak-key"
JOBS = 2000
WARMUP_JOBS = 200
SUBMITTERS = 8
READY_TIMEOUT_S = 180
RUN_DEADLINE_S = 420  # for all jobs of both phases to end
# Anonymous memory (heap, not the mapped shm pool or model files) a worker may gain after warm-up:
# allocator and cache noise, not a per-job leak (1,800 jobs leaking 100 KiB each would be 176 MiB).
ANON_GROWTH_BYTES = 48 * 1024 * 1024
ANON_GROWTH_RATIO = 0.15
SAMPLING = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def data_url(color: tuple[int, int, int], size: tuple[int, int]) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# 64x48 gives 16x1176 float32 pixel_values (past the 64 KiB inline limit: shm); 28x28 stays inline.
SIZES = ((64, 48), (28, 28))
REPEATED = [data_url((17 * i, 255 - 17 * i, 90), SIZES[i % 2]) for i in range(12)]


# Large unique images that fill each CPU worker's in-memory cache tier before the measured run:
# 448x448 is 1024x1176 float32 pixel_values (4.8 MB) on the demo model.
FILL_SIZE = (448, 448)
FILL_FEATURE_BYTES = 1024 * 1176 * 4
LOCAL_CACHE_BYTES = inspect.signature(MultimodalCache).parameters["local_max_bytes"].default
FILL_JOBS = int(1.5 * LOCAL_CACHE_BYTES / FILL_FEATURE_BYTES) + 1


def fill_body(i: int) -> dict:
    url = data_url((i % 256, 7, 250 - i % 200), FILL_SIZE)
    return {"prompt": "<image>Describe.", "content_parts": [{"type": "image_url", "url": url}],
            "sampling_params": SAMPLING, "metadata": {"fill": i}}


def job_body(i: int) -> dict:
    if i % 2 == 0:
        url = REPEATED[(i // 2) % len(REPEATED)]
    else:
        url = data_url((i % 256, (i // 256) % 256, 200), SIZES[(i // 2) % 2])  # unique per job
    return {"prompt": "<image>Describe.", "content_parts": [{"type": "image_url", "url": url}],
            "sampling_params": SAMPLING, "metadata": {"i": i}}


def clean_env(**values: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROLLOUT_")}
    return {**env, "OMP_NUM_THREADS": "1", **values}


@pytest.fixture
def service(tmp_path, demo_model_dir):
    port = free_port()
    env = clean_env(ROLLOUT_STATE_DIR=str(tmp_path / "state"), ROLLOUT_PORT=str(port),
                    ROLLOUT_MODEL=str(demo_model_dir), ROLLOUT_API_KEYS=KEY, ROLLOUT_LOG_LEVEL="WARNING",
                    ROLLOUT_SHM_POOL_BYTES=str(64 * 1024 * 1024), ROLLOUT_API_WORKERS="2")
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up"], cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert up.poll() is None, f"rollout-queue up exited; see {tmp_path / 'up.log'}"
            assert time.monotonic() < deadline, f"not healthy in {READY_TIMEOUT_S}s; see {tmp_path / 'up.log'}"
            try:
                if requests.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        yield up, url
    finally:
        stop(up)
        log.close()


def stop(up: subprocess.Popen) -> None:
    """SIGTERM ``up`` (it stops its children, then Redis); SIGKILL everything left after a minute."""
    try:
        tree = psutil.Process(up.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(60)
    except subprocess.TimeoutExpired:
        up.kill()
    _, alive = psutil.wait_procs(tree, timeout=10)
    for process in alive:
        process.kill()


def worker_processes(up: subprocess.Popen) -> dict[int, str]:
    """pid → role of every service process under ``up`` (API processes and Celery workers)."""
    found = {}
    for process in psutil.Process(up.pid).children(recursive=True):
        try:
            command = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "launcher.cli" in command and "resource_tracker" not in " ".join(command):
            found[process.pid] = " ".join(command[command.index("launcher.cli") + 1:])
    return found


def anon_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for {pid}")


def shm_entries(pids) -> set[str]:
    """/dev/shm entries made by these processes (other test runs may share the machine)."""
    marks = tuple(f"_{pid}_" for pid in pids)
    return {name for name in os.listdir("/dev/shm") if any(mark in name for mark in marks)}


def snapshot(up) -> tuple[dict[int, str], dict[int, int], set[str]]:
    processes = worker_processes(up)
    return processes, {pid: anon_bytes(pid) for pid in processes}, shm_entries(processes)


class Submitter:
    def __init__(self, url: str):
        self.url = url
        self.headers = {"Authorization": f"Bearer {KEY}"}
        self.session = requests.Session()

    def submit(self, body: dict) -> str:
        for _ in range(100):
            response = self.session.post(f"{self.url}/v1/jobs", json=body, headers=self.headers, timeout=30)
            if response.status_code == 202:
                return response.json()["id"]
            assert response.status_code in (429, 503), response.text  # back-pressure: wait and retry
            time.sleep(float(response.headers.get("Retry-After", "1")))
        raise AssertionError(f"job {body['metadata']} was never accepted")

    def get(self, job_id: str) -> dict:
        response = self.session.get(f"{self.url}/v1/jobs/{job_id}", headers=self.headers, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    return sum(values)


def run_phase(url: str, bodies: list[dict], deadline: float) -> list[dict]:
    submitters = [Submitter(url) for _ in range(SUBMITTERS)]
    with ThreadPoolExecutor(SUBMITTERS) as pool:
        ids = list(pool.map(lambda pair: submitters[pair[0] % SUBMITTERS].submit(pair[1]), enumerate(bodies)))
    while metric(url, "rollout_jobs_active") > 0:
        assert time.monotonic() < deadline, f"{metric(url, 'rollout_jobs_active')} jobs still active at the deadline"
        time.sleep(0.5)
    with ThreadPoolExecutor(SUBMITTERS) as pool:
        return list(pool.map(lambda pair: submitters[pair[0] % SUBMITTERS].get(pair[1]), enumerate(ids)))


def test_soak_2000_image_jobs_end_and_leave_no_leak(service):
    up, url = service
    deadline = time.monotonic() + RUN_DEADLINE_S
    started = time.monotonic()

    filled = run_phase(url, [fill_body(i) for i in range(FILL_JOBS)], deadline)
    assert {job["status"] for job in filled} == {"succeeded"}, [job.get("error") for job in filled][:5]
    warm = run_phase(url, [job_body(i) for i in range(WARMUP_JOBS)], deadline)
    time.sleep(2)  # let transport acks drain and pools reclaim
    processes, anon_before, shm_before = snapshot(up)
    main_started = time.monotonic()
    rest = run_phase(url, [job_body(i) for i in range(WARMUP_JOBS, JOBS)], deadline)
    main_s = time.monotonic() - main_started
    time.sleep(2)
    processes_after, anon_after, shm_after = snapshot(up)

    jobs = warm + rest
    assert len({job["id"] for job in jobs}) == JOBS
    failed = [(job["metadata"], job["status"], job.get("error")) for job in jobs if job["status"] != "succeeded"]
    assert not failed, failed[:10]
    assert [job["metadata"]["i"] for job in jobs] == list(range(JOBS))
    assert {job["result"]["transport"] for job in jobs} == {"shm", "inline"}
    assert metric(url, 'rollout_events_total{event="mm_cache_hit"}') >= JOBS // 2 - len(REPEATED)

    # The same processes ran the whole soak (nothing crashed and was replaced), and stayed flat.
    assert processes_after == processes
    report = []
    for pid, role in processes.items():
        before, after = anon_before[pid], anon_after[pid]
        report.append(f"{role} (pid {pid}): anon {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")
    print(f"\nsoak: {JOBS} jobs in {time.monotonic() - started:.0f}s "
          f"({(JOBS - WARMUP_JOBS) / main_s:.1f} jobs/s after warm-up)\n  " + "\n  ".join(report)
          + f"\n  /dev/shm: {sorted(shm_before)} -> {sorted(shm_after)}")
    for pid, role in processes.items():
        growth = anon_after[pid] - anon_before[pid]
        assert growth <= max(ANON_GROWTH_BYTES, ANON_GROWTH_RATIO * anon_before[pid]), (role, growth)
    assert shm_after == shm_before

    # A clean stop leaves nothing behind in /dev/shm either.
    stop(up)
    assert not shm_entries(processes)
