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
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=ROOT, env=clean, capture_output=True,
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


def test_up_serves_the_demo_model_under_its_name(tmp_path, monkeypatch):
    """``up`` hands its children the built demo model's path; OpenAI and vLLM clients still send
    ``model: demo-qwen2.5-omni`` (README's examples), so the children serve it under that name."""
    from domain.models import DEMO_MODEL_NAME
    from domain.settings import Settings, load_settings
    from launcher.stack import child_env

    monkeypatch.delenv("ROLLOUT_SERVED_MODEL_NAME", raising=False)
    demo = child_env(Settings(state_dir=tmp_path), redis_url="redis://r/0", model_path="/built/demo")
    assert demo["ROLLOUT_MODEL"] == "/built/demo" and demo["ROLLOUT_SERVED_MODEL_NAME"] == DEMO_MODEL_NAME
    monkeypatch.setenv("ROLLOUT_SERVED_MODEL_NAME", demo["ROLLOUT_SERVED_MODEL_NAME"])
    assert load_settings().served_model_name == DEMO_MODEL_NAME  # what a child reads
    monkeypatch.delenv("ROLLOUT_SERVED_MODEL_NAME")
    own = child_env(Settings(state_dir=tmp_path, model="/models/mine"), redis_url="redis://r/0",
                    model_path="/models/mine")
    assert "ROLLOUT_SERVED_MODEL_NAME" not in own
    named = child_env(Settings(state_dir=tmp_path, served_model_name="policy"), redis_url="redis://r/0",
                      model_path="/built/demo")
    assert "ROLLOUT_SERVED_MODEL_NAME" not in named  # a name of one's own reaches the children as set
    qwen3 = child_env(Settings(state_dir=tmp_path, demo_model="demo-qwen3"), redis_url="redis://r/0",
                      model_path="/built/demo-qwen3")
    assert qwen3["ROLLOUT_SERVED_MODEL_NAME"] == "demo-qwen3"  # ROLLOUT_DEMO_MODEL picks the built-in one
