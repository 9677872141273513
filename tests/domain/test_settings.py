from dataclasses import fields
from pathlib import Path

import pytest

from domain.settings import Settings, SettingsError, env_name, load_settings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_defaults_load_without_any_variable(monkeypatch):
    for spec in fields(Settings):
        monkeypatch.delenv(env_name(spec.name), raising=False)
    settings = load_settings()
    assert settings.redis_url is None and settings.model is None
    assert settings.visibility_timeout > settings.task_time_limit > settings.task_soft_time_limit


def test_values_are_parsed_and_lists_stripped(monkeypatch):
    monkeypatch.setenv("ROLLOUT_API_KEYS", " a , b ,")
    monkeypatch.setenv("ROLLOUT_OUTBOUND_ALLOWED_PORTS", "80,8080")
    monkeypatch.setenv("ROLLOUT_PORT", "9000")
    monkeypatch.setenv("ROLLOUT_MEDIA_ROOT", "/srv/media")
    settings = load_settings()
    assert settings.api_keys == ("a", "b")
    assert settings.outbound_allowed_ports == (80, 8080)
    assert settings.port == 9000 and settings.media_root == Path("/srv/media")


def test_every_bad_variable_is_named_in_one_error(monkeypatch):
    monkeypatch.setenv("ROLLOUT_PORT", "70000")
    monkeypatch.setenv("ROLLOUT_DEVICE", "tpu")
    monkeypatch.setenv("ROLLOUT_RESULT_TTL", "soon")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    message = caught.value.message
    assert all(name in message for name in ("ROLLOUT_PORT", "ROLLOUT_DEVICE", "ROLLOUT_RESULT_TTL"))


@pytest.mark.parametrize("env", [
    {"ROLLOUT_VISIBILITY_TIMEOUT": "100", "ROLLOUT_TASK_TIME_LIMIT": "200", "ROLLOUT_TASK_SOFT_TIME_LIMIT": "100"},
    {"ROLLOUT_TASK_SOFT_TIME_LIMIT": "700"},
    {"ROLLOUT_OUTBOUND_ALLOW_NETWORKS": "not-a-cidr"},
    {"ROLLOUT_REDIS_URL": "http://localhost:6379"},
    {"ROLLOUT_WEBHOOK_SECRETS": "plain-secret"},
])
def test_inconsistent_settings_are_refused(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError):
        load_settings()


def test_readme_documents_every_setting():
    text = README.read_text()
    missing = [env_name(spec.name) for spec in fields(Settings) if f"`{env_name(spec.name)}`" not in text]
    assert not missing, f"README configuration table lacks {missing}"


def test_multimodal_cache_follows_its_two_settings(monkeypatch, redis_client):
    from workers.runtime import multimodal_cache

    monkeypatch.setenv("ROLLOUT_MM_CACHE_BYTES", "1048576")
    monkeypatch.setenv("ROLLOUT_MM_CACHE_PROCESS_BYTES", "0")
    cache = multimodal_cache(load_settings(), redis_client)
    assert (cache.max_bytes, cache.local_max_bytes) == (1048576, 0)
    monkeypatch.setenv("ROLLOUT_MM_CACHE_BYTES", "0")
    assert multimodal_cache(load_settings(), redis_client) is None


def test_preprocessing_processes_default_to_the_cores_this_process_may_use(monkeypatch):
    import os

    monkeypatch.delenv("ROLLOUT_CPU_CONCURRENCY", raising=False)
    assert load_settings().cpu_concurrency == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # taskset / a container's cpuset
    assert load_settings().cpu_concurrency == 3
    monkeypatch.setenv("ROLLOUT_CPU_CONCURRENCY", "7")
    assert load_settings().cpu_concurrency == 7


def test_a_key_holds_half_the_preprocessing_slots_unless_set(monkeypatch):
    """Issue #47: on two cores the share was two of two slots, so a key's slow media took them all."""
    monkeypatch.delenv("ROLLOUT_CPU_PER_KEY", raising=False)
    for cores, share in ((1, 1), (2, 1), (3, 1), (8, 4)):
        monkeypatch.setenv("ROLLOUT_CPU_CONCURRENCY", str(cores))
        assert load_settings().cpu_key_slots == share
    monkeypatch.setenv("ROLLOUT_CPU_PER_KEY", "3")
    assert load_settings().cpu_key_slots == 3


def test_the_gpu_batch_is_sized_by_the_kv_pool_unless_set(monkeypatch):
    from domain.limits import build_limits

    for name in ("GPU_BATCH_SIZE", "KV_CACHE_TOKENS", "TYPICAL_ROW_TOKENS"):
        monkeypatch.delenv(f"ROLLOUT_{name}", raising=False)
    assert load_settings().batch_rows == 131_072 // 1024
    monkeypatch.setenv("ROLLOUT_KV_CACHE_TOKENS", str(2**20))
    monkeypatch.setenv("ROLLOUT_TYPICAL_ROW_TOKENS", "2048")
    settings = load_settings()
    assert settings.batch_rows == 512 and build_limits(settings, None).scheduler.max_rows == 512
    assert settings.replace(kv_cache_tokens=100).batch_rows == 1  # never below one row
    monkeypatch.setenv("ROLLOUT_GPU_BATCH_SIZE", "24")
    assert load_settings().batch_rows == 24


def test_replica_acks_must_leave_a_replica_to_confirm_after_a_failover(monkeypatch):
    """With as many acks as replicas, a failover left none to confirm: every submit got 503 until
    the old primary came back (issue #49 item 3). Refused at start instead, naming both settings."""
    monkeypatch.setenv("ROLLOUT_EMBEDDED_REDIS", "sentinel")
    monkeypatch.setenv("ROLLOUT_REDIS_REPLICA_ACKS", "1")
    monkeypatch.setenv("ROLLOUT_EMBEDDED_REDIS_REPLICAS", "1")
    with pytest.raises(SettingsError, match="ROLLOUT_EMBEDDED_REDIS_REPLICAS"):
        load_settings()
    monkeypatch.setenv("ROLLOUT_EMBEDDED_REDIS_REPLICAS", "2")
    assert load_settings().embedded_redis_replicas == 2


def test_every_number_declares_its_range_beside_its_field():
    """A numeric setting says its bounds where it is declared (``between``), so a new one cannot be
    added unchecked: ROLLOUT_* values out of range are refused at start, each named."""
    numbers = [spec for spec in fields(Settings) if spec.type.replace(" | None", "") in ("int", "float")]
    assert numbers and [spec.name for spec in numbers if "between" not in spec.metadata] == []
