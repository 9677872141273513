"""Starting workers (workers/worker_main.py): a worker that cannot start its parts exits with a
reason, instead of running on, taking work, with no heartbeat and no sweeps; a CPU pool process is
ready for its first image before it takes one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import empty_db_url

pytestmark = pytest.mark.stack  # workers started as subprocesses (README "Tests")

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def worker_env(redis_url: str, model: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(PYTHONPATH=str(ROOT), ROLLOUT_REDIS_URL=empty_db_url(redis_url, 30), ROLLOUT_MODEL=str(model),
               ROLLOUT_STATE_DIR=str(tmp_path / "state"), ROLLOUT_LOG_LEVEL="WARNING", **extra)
    return env


def test_a_batches_worker_whose_model_config_is_unreadable_exits_and_says_why(redis_url, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")  # a directory, so the CLI takes it; its config is broken
    env = worker_env(redis_url, model, tmp_path)
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "worker", "batches"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "the batches worker could not start" in done.stderr


@pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")
def test_a_cpu_pool_process_reserves_its_transport_pool_before_any_job(redis_url, demo_model_dir, tmp_path):
    # Reserving the pool is the slow part of a first image job (0.45-1.7 s for the default 1 GiB
    # here); each pool process does it at start, so no job waits for it.
    env = worker_env(redis_url, demo_model_dir, tmp_path, ROLLOUT_CPU_CONCURRENCY="1", ROLLOUT_TRANSPORT="shm",
                     ROLLOUT_SHM_POOL_BYTES=str(8 * 1024 * 1024))
    worker = subprocess.Popen([sys.executable, "-m", "launcher.cli", "worker", "cpu"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (segments := _reserved(_segments_of(_children(worker.pid)), 8 * 1024 * 1024)):
            assert worker.poll() is None, worker.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no pool process reserved its pool"
            time.sleep(0.2)
        assert len(segments) == 1
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=60)
    assert not _segments_of({_pid_of(segment) for segment in segments})  # released at shutdown


def test_a_cpu_pool_process_that_cannot_make_its_transport_serves_on_and_says_why(redis_url, demo_model_dir,
                                                                                   tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("cuda_ipc can be made here")
    env = worker_env(redis_url, demo_model_dir, tmp_path, ROLLOUT_CPU_CONCURRENCY="1", ROLLOUT_TRANSPORT="cuda_ipc")
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "launcher.cli", "worker", "cpu"], cwd=ROOT, env=env,
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "has no feature transport" not in log.read_text(errors="replace"):
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.2)
        children = _children(worker.pid)
        time.sleep(3)
        assert children and _children(worker.pid) == children  # not restarted in a loop
        assert "needs CUDA" in log.read_text(errors="replace")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)


def _children(pid: int) -> set[int]:
    try:
        return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except FileNotFoundError:
        return set()


def _segments_of(pids: set[int]) -> list[Path]:
    """The transport segments of the processes ``pids`` (engine/transport/shm.py names them rqt_<pid>_<pool>)."""
    return [path for path in SHM.glob("rqt_*") if _pid_of(path) in pids]


def _reserved(segments: list[Path], size: int) -> list[Path]:
    """The segments whose pages are allocated (created first, then reserved: the pool's constructor)."""
    return [path for path in segments if path.stat().st_blocks * 512 >= size]


def _pid_of(segment: Path) -> int:
    return int(segment.name.split("_")[1])
