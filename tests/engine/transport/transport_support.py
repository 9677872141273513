"""Helpers shared by the transport tests and their agent processes (not a test module)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis
import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
AGENT = HERE / "agent.py"


def make_tensor(spec: dict[str, Any]) -> torch.Tensor:
    """A deterministic tensor from {"dtype", "shape", "seed", optional "noncontiguous"}."""
    dtype = getattr(torch, spec["dtype"])
    shape = list(spec["shape"])
    if spec.get("noncontiguous"):
        shape[-1] *= 2
    gen = torch.Generator().manual_seed(spec["seed"])
    if dtype.is_floating_point:
        tensor = torch.randn(shape, generator=gen).to(dtype)
    elif dtype == torch.bool:
        tensor = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        tensor = torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=torch.int64).to(dtype)
    return tensor[..., ::2] if spec.get("noncontiguous") else tensor


def digest(tensor: torch.Tensor) -> str:
    """Exact identity of a tensor: dtype, shape and every byte."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    h.update(flat.numpy().tobytes())
    return h.hexdigest()


def shm_names(pid: int | None = None) -> set[str]:
    """Our segments in /dev/shm; with ``pid``, only those of pools made by that process (other
    services on this machine may run pools at the same time)."""
    prefix = "rqt_" if pid is None else f"rqt_{pid}_"
    return {p.name for p in Path("/dev/shm").glob(f"{prefix}*")}


class AgentError(Exception):
    def __init__(self, error: dict[str, Any]):
        super().__init__(f"{error.get('type')}: {error.get('message')}")
        self.type = error.get("type")
        self.code = error.get("code")


class Agent:
    """A producer or consumer in its own, unrelated Python process, driven through Redis."""

    def __init__(self, redis_url: str, name: str, log_dir: Path):
        self.name = name
        self.client = redis.Redis.from_url(redis_url)
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(AGENT), redis_url, name],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a SIGKILL hits only what we aim at
            )

    @property
    def cmd_key(self) -> str:
        return f"rqt-test:{self.name}:cmd"

    @property
    def reply_key(self) -> str:
        return f"rqt-test:{self.name}:reply"

    def wait_ready(self, timeout: float = 60) -> dict[str, Any]:
        return self.reply(timeout)

    def send(self, op: str, **args: Any) -> None:
        self.client.rpush(self.cmd_key, json.dumps({"op": op, **args}))

    def reply(self, timeout: float = 60) -> Any:
        got = self.client.blpop([self.reply_key], timeout=timeout)
        if got is None:
            raise AssertionError(f"agent {self.name} gave no answer in {timeout}s:\n{self.log()}")
        answer = json.loads(got[1])
        if "error" in answer:
            raise AgentError(answer["error"])
        return answer["ok"]

    def call(self, op: str, timeout: float = 60, **args: Any) -> Any:
        self.send(op, **args)
        return self.reply(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        self.request_stop()
        self.wait_stopped()

    def request_stop(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")

    def wait_stopped(self) -> None:
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
