"""``up``'s Sentinel topology (domain/infra/redis_server.LocalFailoverGroup) heals after any single
kill, as many times as asked (issue #49 item 2): a server started again takes the role the
sentinels give it now. Before, a promoted replica killed once came back as a replica of its own
replica (each replicated the other, no primary for good), and a failed-over primary came back a
primary with stale data. Real redis-servers and sentinels on loopback; writes flow throughout, each
acknowledged only once a replica holds it (``WAIT``), and every acknowledged write survives."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from redis.sentinel import Sentinel

from domain.infra.redis_server import LocalFailoverGroup

pytestmark = pytest.mark.stack  # Redis primaries killed and failed over (README "Tests")


def role(port: int) -> tuple[str | None, int | None]:
    """A server's role and, for a replica, its primary's port (None, None when it does not answer)."""
    try:
        with redis.Redis(port=port, socket_timeout=1) as client:
            info = client.info("replication")
    except redis.RedisError:
        return None, None
    return info["role"], info.get("master_port")


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class AcknowledgedWrites:
    """Writes a key every 20 ms through the sentinels; keeps those a replica acknowledged."""

    def __init__(self, group: LocalFailoverGroup):
        sentinel = Sentinel([("127.0.0.1", s.port) for s in group.sentinels], socket_timeout=0.5)
        self.client = sentinel.master_for(group.master, socket_timeout=0.5)
        self.acknowledged: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                self.client.set(f"write:{n}", n)
                if self.client.execute_command("WAIT", 1, 500) >= 1:
                    self.acknowledged.append((time.monotonic(), n))
            except redis.RedisError:
                pass  # no primary known this moment: the failover window
            self._stop.wait(0.02)

    def since(self, at: float) -> int:
        return sum(1 for when, _ in self.acknowledged if when > at)

    def __enter__(self) -> AcknowledgedWrites:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def settled(group: LocalFailoverGroup) -> bool:
    """One primary, every other server its replica with the link up, and the sentinels naming it."""
    primary = group.primary_port()
    roles = {server.port: role(server.port) for server in group.servers}
    if [port for port, (name, _) in roles.items() if name == "master"] != [primary]:
        return False
    for server in group.servers:
        if server.port != primary:
            with redis.Redis(port=server.port, socket_timeout=1) as client:
                info = client.info("replication")
            if info.get("master_port") != primary or info.get("master_link_status") != "up":
                return False
    return True


def kill(server) -> float:
    server._process.kill()
    server._process.wait()
    return time.monotonic()


def test_the_serving_primary_killed_three_times_in_a_row_heals_each_time(tmp_path):
    with LocalFailoverGroup(tmp_path / "redis", replicas=2) as group, AcknowledgedWrites(group) as writes:
        wait_until(lambda: writes.since(0) >= 5, 20, "the first acknowledged writes")
        # 1. A real failover: the primary stays dead until a replica is promoted, then comes back
        #    (a dead machine rebooted) and must come back as that replica's replica, never a primary.
        old = group.serving()
        killed = kill(old)
        wait_until(lambda: group.primary_port() not in (None, old.port), 30, "a replica promoted")
        group.restart(old)
        assert role(old.port) == ("slave", group.primary_port())
        wait_until(lambda: settled(group) and writes.since(killed) >= 5, 30, "the group to settle, writes again")

        # 2. The promoted replica (built as a replica of the first primary) is killed and started
        #    again half a second later, as up's supervisor does, before the sentinels see it down:
        #    they still name it, so it comes back the primary, not a replica of its own replica.
        promoted = group.serving()
        killed = kill(promoted)
        time.sleep(0.5)
        group.restart(promoted)
        assert role(promoted.port)[0] == "master"
        wait_until(lambda: settled(group) and writes.since(killed) >= 5, 30, "the group to settle, writes again")

        # 3. And a real failover again from there.
        third = group.serving()
        killed = kill(third)
        wait_until(lambda: group.primary_port() not in (None, third.port), 30, "a replica promoted again")
        group.restart(third)
        assert role(third.port) == ("slave", group.primary_port())
        wait_until(lambda: settled(group) and writes.since(killed) >= 5, 30, "the group to settle, writes again")

        with redis.Redis(port=group.primary_port()) as client:
            kept = client.mget([f"write:{n}" for _, n in writes.acknowledged])
        assert None not in kept, f"{kept.count(None)} of {len(kept)} acknowledged writes lost"

