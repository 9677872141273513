"""A worker that cannot start its parts exits with a reason (workers/worker_main.py), instead of
running on, taking work, with no heartbeat and no sweeps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import empty_db_url

ROOT = Path(__file__).resolve().parents[2]


def test_a_batches_worker_whose_model_config_is_unreadable_exits_and_says_why(redis_url, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")  # a directory, so the CLI takes it; its config is broken
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(PYTHONPATH=str(ROOT), ROLLOUT_REDIS_URL=empty_db_url(redis_url, 30), ROLLOUT_MODEL=str(model),
               ROLLOUT_STATE_DIR=str(tmp_path / "state"), ROLLOUT_LOG_LEVEL="WARNING")
    done = subprocess.run([sys.executable, "-m", "web.cli", "worker", "batches"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "the batches worker could not start" in done.stderr
