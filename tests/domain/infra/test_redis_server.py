"""The embedded Redis keeps its append-only file as ROLLOUT_REDIS_FSYNC says, and what it
acknowledged is there after a kill -9 and a restart on the same directory."""

from __future__ import annotations

import os
import signal

import pytest
import redis

from domain.infra.redis_server import EmbeddedRedis
from domain.settings import SettingsError, load_settings


@pytest.mark.parametrize("fsync", ["everysec", "always"])
def test_an_acknowledged_write_survives_a_kill_and_a_restart(tmp_path, fsync):
    server = EmbeddedRedis(tmp_path / "redis", fsync=fsync).start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendfsync") == {"appendfsync": fsync}
        client.hset("rq:job:job_durable", mapping={"status": "queued"})
        client.close()
        os.kill(server.pid, signal.SIGKILL)  # no shutdown: nothing flushed on the way out
        server._process.wait()
        server.start()
        client = redis.Redis.from_url(server.url)
        assert client.hget("rq:job:job_durable", "status") == b"queued"
        client.close()
    finally:
        server.stop()


def test_an_unknown_fsync_policy_is_refused(monkeypatch):
    monkeypatch.setenv("ROLLOUT_REDIS_FSYNC", "sometimes")
    with pytest.raises(SettingsError):
        load_settings()
