"""Worker processes for tests, forked from one interpreter that has already imported what workers
import (a fork server), instead of a fresh ``python -m launcher.cli worker KIND`` each time.

Why: the suite starts about a hundred workers, and each fresh interpreter spends 2 to 6 CPU
seconds importing torch, transformers and the processors before it takes work: half the suite's
CPU on 2 cores. A forked child runs the same entry point (``launcher.cli.main(["worker", kind])``)
with the environment, working directory and log file a ``Popen`` would give it; only the imports
are already done. ``ROLLOUT_TEST_EXEC_WORKERS=1`` starts every worker as a fresh interpreter
instead, and ``tests/e2e/test_supervisor.py`` always does (``rollout-queue up`` execs each kind).

The standard library's ``multiprocessing`` forkserver cannot serve here: its children are
``multiprocessing.Process`` targets, not processes with their own stdout, environment and a
``Popen``-like handle that tests signal, pause and reap.

The server is single-threaded (a fork copies only the calling thread, so no other thread may hold
a lock at the fork): it reads one JSON request per line on stdin, answers one JSON line on stdout,
and reaps its ended children before each answer. A pid is signalled only while the server has not
reaped it, so a signal never reaches a recycled pid. It ends, killing its children, when its stdin
closes: when the test process is gone, however it ended (its children die with it, by
``PR_SET_PDEATHSIG``; the server itself has none, which would tie it to the thread that started it).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXEC_VARIABLE = "ROLLOUT_TEST_EXEC_WORKERS"
# What every worker kind imports before it takes work; a child imports anything else itself.
PRELOAD = (
    "launcher.cli",
    "workers.worker_main",
    "workers.tasks.cpu", "workers.tasks.render", "workers.tasks.gpu", "workers.tasks.webhooks",
    "workers.tasks.batches", "workers.tasks.score_lines",
    "processors.registry",
    "engine.loading", "engine.generation",
    "celery.apps.worker", "celery.worker.consumer", "celery.concurrency.prefork",
    "celery.concurrency.solo", "celery.concurrency.thread",
)


def start_worker(kind: str, env: dict[str, str], log_path: Path | str | None = None):
    """Run ``rollout-queue worker KIND`` with ``env`` (the whole environment), output to ``log_path``
    (appended; discarded when None). Returns a ``subprocess.Popen`` or a :class:`ForkedProcess`."""
    argv = ["worker", kind]
    if os.environ.get(EXEC_VARIABLE) == "1":
        with open(log_path or os.devnull, "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "launcher.cli", *argv], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    return _server().start(argv, env, log_path)


def die_with_parent() -> None:
    # A test run that dies without its teardown (a hard timeout) must not leave workers behind,
    # retrying forever against a Redis that is gone.
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ForkedProcess:
    """The part of ``subprocess.Popen`` tests use, for a child of the fork server."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.request(op="poll", pid=self.pid)["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.server.request(op="signal", pid=self.pid, signal=int(sig))

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """This test process's handle on its fork server (started on first use, ended with it)."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-m", "tests.worker_forks"], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.lock = threading.Lock()
        atexit.register(self.close)
        ready = self.process.stdout.readline()
        if json.loads(ready or "{}").get("ready") is not True:
            raise RuntimeError(f"the worker fork server did not start (exit {self.process.poll()})")

    def start(self, argv: list[str], env: dict[str, str], log_path) -> ForkedProcess:
        pid = self.request(op="start", argv=argv, env=env, cwd=str(ROOT),
                           log=str(log_path) if log_path else os.devnull)["pid"]
        return ForkedProcess(self, pid, ["rollout-queue", *argv])

    def close(self) -> None:
        """End the server (it kills the children still running) and reap it."""
        self.process.stdin.close()
        self.process.wait(30)

    def request(self, **message) -> dict:
        with self.lock:
            self.process.stdin.write(json.dumps(message).encode() + b"\n")
            self.process.stdin.flush()
            answer = json.loads(self.process.stdout.readline() or "{}")
        if "error" in answer or not answer:
            raise RuntimeError(f"worker fork server: {answer.get('error', 'gone')}")
        return answer


_SERVER: ForkServer | None = None
_SERVER_LOCK = threading.Lock()


def _server() -> ForkServer:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or _SERVER.process.poll() is not None:
            _SERVER = ForkServer()
        return _SERVER


# --- the server: ``python -m tests.worker_forks`` ------------------------------------------------


def serve() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    exited: dict[int, int] = {}
    children: set[int] = set()

    def reap() -> None:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                exited[pid] = os.waitstatus_to_exitcode(status)

    requests, answers = sys.stdin.buffer, sys.stdout.buffer

    def answer(message: dict) -> None:
        answers.write(json.dumps(message).encode() + b"\n")
        answers.flush()

    answer({"ready": True})
    for line in requests:
        request = json.loads(line)
        reap()
        op = request["op"]
        if op == "start":
            pid = os.fork()
            if pid == 0:
                _run_child(request)  # never returns
            children.add(pid)
            answer({"pid": pid})
        elif op == "poll":
            answer({"returncode": exited.get(request["pid"])})
        elif op == "signal":
            if request["pid"] in children:  # not reaped: the pid is still this child's
                os.kill(request["pid"], request["signal"])
            answer({"signalled": request["pid"] in children})
        else:
            answer({"error": f"unknown op {op!r}"})
    for pid in children:  # stdin closed: the test process is gone
        os.kill(pid, signal.SIGKILL)


def _run_child(request: dict) -> None:
    code = 1
    try:
        die_with_parent()
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["rollout-queue", *request["argv"]]
        from launcher.cli import main

        code = main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code or 0)


if __name__ == "__main__":
    serve()
