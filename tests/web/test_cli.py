"""`rollout-queue` turns every mistake a user can make at start into one error line and exit 2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_cli(args, tmp_path, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    clean.update({"ROLLOUT_STATE_DIR": str(tmp_path), **env})
    return subprocess.run([sys.executable, "-m", "web.cli", *args], cwd=ROOT, env=clean, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("case", ["bad setting", "model missing", "port in use", "redis unreachable", "api without redis"])
def test_start_up_mistakes_are_one_line_and_exit_2(case, tmp_path, busy_port, demo_model_dir):
    args, env, expected = {
        "bad setting": (["up"], {"ROLLOUT_PORT": "eighty"}, "ROLLOUT_PORT"),
        "model missing": (["up"], {"ROLLOUT_MODEL": str(tmp_path / "nope")}, "ROLLOUT_MODEL"),
        "port in use": (["up"], {"ROLLOUT_PORT": str(busy_port)}, f"port {busy_port}"),
        "redis unreachable": (["up"], {"ROLLOUT_REDIS_URL": "redis://127.0.0.1:1/0",
                                       "ROLLOUT_MODEL": str(demo_model_dir)}, "cannot reach Redis"),
        "api without redis": (["api"], {}, "ROLLOUT_REDIS_URL"),
    }[case]
    result = run_cli(args, tmp_path, **env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = [text for text in result.stderr.splitlines() if text.startswith("rollout-queue: error:")]
    assert expected in line
