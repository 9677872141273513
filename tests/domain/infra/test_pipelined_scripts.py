"""Scripts in one pipeline (domain/infra/pipelined_scripts.py): no SCRIPT EXISTS before it when
Redis has them, each call run exactly once when its cache was emptied (a restart, a failover), errors raised."""

from __future__ import annotations

import pytest
import redis

from domain.infra.pipelined_scripts import run_scripts
from tests.conftest import empty_db_url

COUNT = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
FAIL = "return redis.error_reply('refused')"


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(empty_db_url(redis_url, 23)) as client:
        yield client


def test_calls_run_in_order_without_script_exists_and_each_once_after_the_cache_was_flushed(client):
    count = client.register_script(COUNT)
    calls = [(count, ["a"], [1]), (count, ["b"], [10]), (count, ["a"], [100])]
    client.script_flush()
    assert run_scripts(client, calls) == [1, 10, 101]  # NOSCRIPT: loaded, and each ran once
    client.config_resetstat()
    assert run_scripts(client, calls) == [102, 20, 202]
    commands = client.info("commandstats")
    assert commands["cmdstat_evalsha"]["calls"] == 3 and "cmdstat_script" not in commands  # no SCRIPT EXISTS
    assert client.mget("a", "b") == [b"202", b"20"]


def test_a_calls_error_is_raised_after_the_others_ran(client):
    count, fail = client.register_script(COUNT), client.register_script(FAIL)
    with pytest.raises(redis.ResponseError, match="refused"):
        run_scripts(client, [(count, ["a"], [1]), (fail, [], []), (count, ["a"], [1])])
    assert client.get("a") == b"2"
    assert run_scripts(client, []) == []
