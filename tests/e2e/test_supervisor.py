"""``rollout-queue up`` keeps its children alive (issue 14, item 6).

The stack runs exactly as a user starts it (``rollout-queue up``, embedded Redis). Under load, each
child kind is killed with SIGKILL: the GPU worker alone first (one OOM kill used to stop
everything within 2 s), then the API and the CPU, webhook and batch workers together, then Redis.
After each, ``up`` must still run, must have started the dead children again by itself, and
``/healthz`` must come back; in the end every job has ended once, succeeded, with one webhook
event. The Celery limits are small so that a dead worker's messages come back in seconds.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import psutil
import pytest
import requests
from PIL import Image

from domain.infra.redis_server import free_port
from tests.e2e.conftest import ROOT, WEBHOOK_SECRET

KEY = "supervisor-key"
HOOK = "/hooks/supervisor"
RECOVER_S = 180.0
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def png(color) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def up(tmp_path, demo_model_dir, loopback_host):
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROLLOUT_")}
    env.update(OMP_NUM_THREADS="1", ROLLOUT_STATE_DIR=str(tmp_path / "state"), ROLLOUT_PORT=str(port),
               ROLLOUT_MODEL=str(demo_model_dir), ROLLOUT_API_KEYS=KEY, ROLLOUT_API_WORKERS="1",
               ROLLOUT_LOG_LEVEL="WARNING", ROLLOUT_CPU_CONCURRENCY="2",
               ROLLOUT_SHM_POOL_BYTES=str(64 * 1024 * 1024),
               ROLLOUT_VISIBILITY_TIMEOUT="10", ROLLOUT_TASK_TIME_LIMIT="8", ROLLOUT_TASK_SOFT_TIME_LIMIT="6",
               ROLLOUT_STALLED_JOB_AFTER="5",
               ROLLOUT_OUTBOUND_ALLOW_NETWORKS="127.0.0.0/8", ROLLOUT_OUTBOUND_ALLOWED_PORTS=str(loopback_host.port),
               ROLLOUT_WEBHOOK_SECRETS=WEBHOOK_SECRET, ROLLOUT_WEBHOOK_RETRY_SCHEDULE="0.5,1,1,2,2,2,2,2")
    log_path = tmp_path / "up.log"
    log = open(log_path, "wb")
    process = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up"], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log_path)
        yield process, url, log_path
    finally:
        tree = psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        for child in psutil.wait_procs(tree, timeout=10)[1]:
            child.kill()
        log.close()


def wait_healthy(process, url: str, log_path, timeout: float = RECOVER_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"rollout-queue up exited ({process.returncode}); see {log_path}"
        assert time.monotonic() < deadline, f"not healthy again in {timeout:.0f} s; see {log_path}"
        try:
            if requests.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)


def children(process) -> dict[str, int]:
    """Role → pid of ``up``'s direct children (``api``, ``cpu``, ``gpu``, ``webhooks``, ``batches``, ``redis``)."""
    found = {}
    for child in psutil.Process(process.pid).children():
        try:
            cmdline = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if cmdline and "redis-server" in os.path.basename(cmdline[0]):
            found["redis"] = child.pid
        elif "launcher.cli" in cmdline:
            found[cmdline[-1]] = child.pid
    return found


def submit_wave(url: str, host, tag: str, count: int = 6) -> list[str]:
    headers = {"Authorization": f"Bearer {KEY}"}
    webhook = {"url": host.url(HOOK)}
    ids = []
    for i in range(count):
        if i % 2:
            body = {"token_ids": [100 + i, 120, 130], "sampling_params": GREEDY, "webhook": webhook}
        else:
            media = host.route(f"/media/sup-{tag}-{i}.png", (200, {"Content-Type": "image/png"},
                                                            png((20 * i, 60, 200)), 0.3))
            body = {"prompt": "<image>Describe.", "content_parts": [{"type": "image_url", "url": media}],
                    "sampling_params": GREEDY, "webhook": webhook}
        response = requests.post(f"{url}/v1/jobs", json=body, headers=headers, timeout=30)
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    return ids


def wait_until_taken(url: str, ids: list[str], timeout: float = 60.0) -> None:
    """Until no job of ``ids`` is still ``queued`` (each message taken by a worker)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + timeout
    while any(requests.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=10).json()["status"] == "queued"
              for job_id in ids):
        assert time.monotonic() < deadline, "jobs still queued"
        time.sleep(0.05)


def kill_and_recover(process, url: str, log_path, roles: list[str]) -> None:
    before = children(process)
    for role in roles:
        os.kill(before[role], signal.SIGKILL)
    time.sleep(2.0)  # what used to take the whole stack down
    assert process.poll() is None, f"up exited after kill -9 of {roles}; see {log_path}"
    deadline = time.monotonic() + RECOVER_S
    while True:
        now = children(process)
        if all(now.get(role) not in (None, before[role]) for role in roles):
            break
        assert time.monotonic() < deadline, f"{roles} not restarted: {before} -> {now}; see {log_path}"
        time.sleep(0.5)
    wait_healthy(process, url, log_path)


def test_up_restarts_every_child_kind_killed_under_load(up, loopback_host):
    process, url, log_path = up
    loopback_host.route(HOOK, (200, {}, b""))
    jobs = submit_wave(url, loopback_host, "gpu")
    kill_and_recover(process, url, log_path, ["gpu"])
    jobs += submit_wave(url, loopback_host, "workers")
    kill_and_recover(process, url, log_path, ["api", "cpu", "webhooks", "batches"])
    wave = submit_wave(url, loopback_host, "redis")
    # Killed with this wave's jobs in flight. A message popped but not yet recorded when Redis
    # dies is lost; the workers' sweep queues its job again (domain/jobs/reaper.py).
    wait_until_taken(url, wave)
    jobs += wave
    kill_and_recover(process, url, log_path, ["redis"])
    jobs += submit_wave(url, loopback_host, "after")

    headers = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + RECOVER_S
    pending = set(jobs)
    while pending and time.monotonic() < deadline:
        for job_id in list(pending):
            job = requests.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=10).json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                assert job["status"] == "succeeded", job
                pending.discard(job_id)
        time.sleep(0.5)
    assert not pending, f"{len(pending)} jobs never ended; see {log_path}"

    events = defaultdict(set)  # job id -> webhook ids (a redelivered attempt repeats its id)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        events.clear()
        for _method, hook_headers, body in list(loopback_host.requests[HOOK]):
            payload = json.loads(body)
            assert payload["type"] == "job.succeeded"
            events[payload["data"]["id"]].add(hook_headers["webhook-id"])
        if set(jobs) <= set(events):
            break
        time.sleep(0.5)
    assert {job_id: len(events[job_id]) for job_id in jobs} == dict.fromkeys(jobs, 1), "one webhook event per job"
    log = log_path.read_text()
    assert "restarting" in log and "restarted" in log, "up logs the deaths and restarts it handled"
