"""Redis' memory bound (domain/infra/redis_memory.py) on a real embedded Redis: the bound it starts
with, the gauge that reads it at most once a second, and a write Redis refuses for memory told
apart from Redis being away, by type and by Redis' own memory, never by message text."""

from __future__ import annotations

import os

import pytest
import redis

from domain.infra.redis_memory import (
    MemoryGauge,
    default_maxmemory_bytes,
    machine_memory_bytes,
    read_memory,
)
from domain.infra.redis_server import EmbeddedRedis
from domain.infra.store_errors import StoreFull
from domain.settings import SettingsError, load_settings
from engine.errors import ServiceUnavailableError

MIB = 2**20


def fill_until(client: redis.Redis, used_bytes: int, *, key: str = "filler") -> None:
    """Write 32 KiB values under ``key:N`` until Redis' used_memory reaches ``used_bytes`` (or its
    maxmemory, where it refuses the next write)."""
    index = 0
    while int(client.info("memory")["used_memory"]) < used_bytes:
        try:
            client.set(f"{key}:{index}", os.urandom(32 * 1024))
        except redis.exceptions.OutOfMemoryError:
            return
        index += 1


@pytest.fixture
def bounded_redis(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", persistent=False, maxmemory=8 * MIB).start()
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()
    server.stop()


def test_the_default_bound_is_a_quarter_of_the_machine():
    assert default_maxmemory_bytes(16 * 2**30) == 4 * 2**30
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < machine_memory_bytes() <= physical  # a container's limit when it is lower
    assert default_maxmemory_bytes() == machine_memory_bytes() // 4


def test_the_setting_is_read_in_bytes(monkeypatch):
    assert load_settings().redis_maxmemory_bytes is None
    monkeypatch.setenv("ROLLOUT_REDIS_MAXMEMORY_BYTES", str(512 * MIB))
    assert load_settings().redis_maxmemory_bytes == 512 * MIB
    for bad in ("-1", "2g"):
        monkeypatch.setenv("ROLLOUT_REDIS_MAXMEMORY_BYTES", bad)
        with pytest.raises(SettingsError, match="ROLLOUT_REDIS_MAXMEMORY_BYTES"):
            load_settings()


def test_the_embedded_redis_has_its_bound_and_never_evicts(bounded_redis):
    assert bounded_redis.config_get("maxmemory") == {"maxmemory": str(8 * MIB)}
    assert bounded_redis.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    use = read_memory(bounded_redis)
    assert use.maxmemory_bytes == 8 * MIB and 0 < use.used_bytes < use.high_water_bytes
    assert not use.above_high_water and not use.full


def test_the_gauge_reads_redis_at_most_once_a_second(bounded_redis):
    now = [100.0]
    gauge = MemoryGauge(bounded_redis, clock=lambda: now[0])
    first = gauge.read()
    fill_until(bounded_redis, first.used_bytes + MIB)
    now[0] += 0.9
    assert gauge.read() is first  # within the second: no round trip
    now[0] += 0.1
    assert gauge.read().used_bytes >= first.used_bytes + MIB


def test_the_gauge_admits_up_to_the_high_water_mark(bounded_redis):
    gauge = MemoryGauge(bounded_redis)
    gauge.admit()
    fill_until(bounded_redis, int(0.92 * 8 * MIB))
    gauge.read(fresh=True)
    with pytest.raises(StoreFull) as refused:
        gauge.admit()
    assert refused.value.code == "redis_memory_full" and isinstance(refused.value, ServiceUnavailableError)
    assert refused.value.errors["maxmemory_bytes"] == 8 * MIB
    bounded_redis.set("accepted-work", b"x" * 1024)  # the room above the mark is the accepted work's


def test_a_write_refused_for_memory_is_told_from_redis_away(bounded_redis):
    gauge = MemoryGauge(bounded_redis)
    bounded_redis.set("a-string", "x")
    with pytest.raises(redis.ResponseError) as wrong_type:  # a reply that is not about memory
        bounded_redis.lpush("a-string", "y")
    assert gauge.refusal_for(wrong_type.value) is None
    assert gauge.refusal_for(redis.ConnectionError("gone")) is None

    fill_until(bounded_redis, 7 * MIB)
    bounded_redis.config_set("maxmemory", 6 * MIB)  # past the bound: noeviction refuses writes
    with pytest.raises(redis.exceptions.OutOfMemoryError) as command:
        bounded_redis.set("one-more", "x")
    with pytest.raises(redis.ResponseError) as script:  # Redis 6 wraps a script's OOM in a plain error
        bounded_redis.eval("return redis.call('set', KEYS[1], 'x')", 1, "one-more")
    for refused in (command.value, script.value):
        full = gauge.refusal_for(refused)
        assert isinstance(full, StoreFull), refused
        assert full.errors == {"used_bytes": full.errors["used_bytes"], "maxmemory_bytes": 6 * MIB}
    assert bounded_redis.delete("filler:0") == 1  # what frees memory still runs
