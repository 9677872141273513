"""Where Redis is (domain/redis_target.py): one URL for a server or a Sentinel-watched primary,
read into each library's own form; and the settings that build it."""

from __future__ import annotations

import pytest

from domain.redis_target import SentinelTarget, broker_options, parse_sentinel_url, sentinel_url
from domain.settings import SettingsError, load_settings


def test_a_sentinel_url_names_its_sentinels_master_and_database():
    url = sentinel_url(("10.0.0.1:26379", "sentinel-2:26380"), "rollout", 3)
    assert url == "redis+sentinel://10.0.0.1:26379,sentinel-2:26380/rollout/3"
    assert parse_sentinel_url(url) == SentinelTarget((("10.0.0.1", 26379), ("sentinel-2", 26380)), "rollout", 3)
    assert parse_sentinel_url("redis+sentinel://h:1/m").db == 0
    assert parse_sentinel_url("redis://127.0.0.1:6379/0") is None


@pytest.mark.parametrize("url", ["redis+sentinel:///m", "redis+sentinel://h/m", "redis+sentinel://h:x/m",
                                 "redis+sentinel://h:1", "redis+sentinel://h:1/m/zero", "redis+sentinel://h:1/m/0/9"])
def test_a_malformed_sentinel_url_is_refused(url):
    with pytest.raises(ValueError):
        parse_sentinel_url(url)


def test_celery_gets_kombus_sentinel_transport_and_the_master_name():
    broker, options = broker_options("redis+sentinel://a:1,b:2/rollout/4")
    assert broker == "sentinel://a:1/4;sentinel://b:2/4" and options["master_name"] == "rollout"
    assert broker_options("redis://x:6379/0") == ("redis://x:6379/0", {})


def test_the_sentinel_settings_build_the_target_every_process_uses(monkeypatch):
    monkeypatch.delenv("ROLLOUT_REDIS_URL", raising=False)
    monkeypatch.setenv("ROLLOUT_REDIS_SENTINELS", "s1:26379,s2:26379,s3:26379")
    monkeypatch.setenv("ROLLOUT_REDIS_SENTINEL_MASTER", "mymaster")
    assert load_settings().redis_target == "redis+sentinel://s1:26379,s2:26379,s3:26379/mymaster/0"
    monkeypatch.setenv("ROLLOUT_REDIS_URL", "redis://elsewhere:6379/0")
    with pytest.raises(SettingsError, match="not both"):
        load_settings()
    monkeypatch.delenv("ROLLOUT_REDIS_SENTINELS")
    monkeypatch.setenv("ROLLOUT_REDIS_URL", "redis+sentinel://s1:26379/mymaster/1")
    assert load_settings().redis_target.endswith("/mymaster/1")
    monkeypatch.setenv("ROLLOUT_REDIS_URL", "redis+sentinel://s1/mymaster")
    with pytest.raises(SettingsError, match="host:port"):
        load_settings()
