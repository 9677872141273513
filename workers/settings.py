"""Settings: the only module that reads the environment.

Entry points call :func:`load_settings` once and pass the frozen :class:`Settings` down. Every
variable has the prefix ``ROLLOUT_``; all bad values are reported together, each naming its variable.
Tests build ``Settings(...)`` directly instead of touching the environment.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from environs import Env, EnvError

from engine.errors import InvalidRequestError


class SettingsError(InvalidRequestError):
    code = "invalid_settings"


def _default_state_dir() -> Path:
    return Path.home() / ".rollout-queue"


@dataclass(frozen=True)
class Settings:
    redis_url: str | None = None
    state_dir: Path = field(default_factory=_default_state_dir)
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    weight_version: str | None = None
    api_keys: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    api_workers: int = 2
    node_id: str = field(default_factory=socket.gethostname)
    result_ttl: int = 7 * 24 * 3600
    default_max_tokens: int = 64
    max_model_len: int | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    max_content_parts: int = 16
    max_metadata_bytes: int = 4096
    max_queued_per_key: int = 10_000
    max_queued_total: int = 100_000
    sync_timeout_max: float = 300.0
    # Celery time limits. The broker's visibility timeout must exceed the hard limit, or Redis
    # redelivers a message whose task is still running and the job runs twice.
    task_soft_time_limit: int = 540
    task_time_limit: int = 600
    visibility_timeout: int = 3600
    gpu_batch_size: int = 16
    gpu_batch_wait_ms: int = 5
    torch_threads: int = 1
    cpu_concurrency: int = 1
    # Guarded fetching (processors.fetch).
    allowed_media_domains: tuple[str, ...] = ()
    outbound_allow_networks: tuple[str, ...] = ()
    outbound_allowed_ports: tuple[int, ...] = (80, 443)
    media_root: Path | None = None
    media_max_bytes: int = 64 * 1024 * 1024
    fetch_connect_timeout: float = 5.0
    fetch_timeout: float = 30.0
    fetch_retries: int = 2
    max_image_pixels: int = 40_000_000
    max_video_frames: int = 256
    max_media_seconds: float = 600.0
    # Multimodal cache and feature transport.
    mm_cache_bytes: int = 512 * 1024 * 1024
    transport: str = "auto"
    shm_pool_bytes: int = 1024 * 1024 * 1024
    handle_ack_timeout: float = 600.0
    # Webhooks.
    webhook_secrets: tuple[str, ...] = ()
    webhook_retry_schedule: tuple[float, ...] = (5, 30, 120, 600, 1800, 3600, 7200, 14400, 28800, 28800)
    webhook_timeout: float = 10.0
    key_webhooks: Mapping[str, str] = field(default_factory=dict)
    # Batches.
    batch_max_lines: int = 50_000
    batch_max_bytes: int = 200 * 1024 * 1024
    batch_chunk_size: int = 64
    batch_completion_window: int = 24 * 3600
    log_level: str = "INFO"

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)

    @property
    def generate_queue(self) -> str:
        return f"generate.{self.node_id}"


def load_settings() -> Settings:
    """Parse every ``ROLLOUT_*`` variable; raise one :class:`SettingsError` naming each bad one."""
    env = Env(eager=False, expand_vars=False, prefix="ROLLOUT_")
    defaults = Settings()
    values = dict(
        redis_url=env.str("REDIS_URL", None) or None,
        state_dir=env.path("STATE_DIR", defaults.state_dir),
        model=env.str("MODEL", None) or None,
        device=env.str("DEVICE", "auto", validate=_one_of("auto", "cpu", "cuda")),
        dtype=env.str("DTYPE", "auto", validate=_one_of("auto", "float32", "bfloat16", "float16")),
        weight_version=env.str("WEIGHT_VERSION", None) or None,
        api_keys=tuple(_clean(env.list("API_KEYS", []))),
        host=env.str("HOST", defaults.host),
        port=env.int("PORT", defaults.port, validate=_between(1, 65535)),
        api_workers=env.int("API_WORKERS", defaults.api_workers, validate=_between(1, 64)),
        node_id=env.str("NODE_ID", defaults.node_id, validate=_node_id),
        result_ttl=env.int("RESULT_TTL", defaults.result_ttl, validate=_between(60, 10**9)),
        default_max_tokens=env.int(
            "DEFAULT_MAX_TOKENS", defaults.default_max_tokens, validate=_between(1, 10**6)
        ),
        max_model_len=env.int("MAX_MODEL_LEN", None),
        max_body_bytes=env.int("MAX_BODY_BYTES", defaults.max_body_bytes, validate=_between(1024, 2**34)),
        max_content_parts=env.int(
            "MAX_CONTENT_PARTS", defaults.max_content_parts, validate=_between(0, 1024)
        ),
        max_queued_per_key=env.int(
            "MAX_QUEUED_PER_KEY", defaults.max_queued_per_key, validate=_between(1, 10**9)
        ),
        max_queued_total=env.int("MAX_QUEUED_TOTAL", defaults.max_queued_total, validate=_between(1, 10**9)),
        task_soft_time_limit=env.int(
            "TASK_SOFT_TIME_LIMIT", defaults.task_soft_time_limit, validate=_between(1, 10**6)
        ),
        task_time_limit=env.int("TASK_TIME_LIMIT", defaults.task_time_limit, validate=_between(1, 10**6)),
        visibility_timeout=env.int(
            "VISIBILITY_TIMEOUT", defaults.visibility_timeout, validate=_between(1, 10**7)
        ),
        gpu_batch_size=env.int("GPU_BATCH_SIZE", defaults.gpu_batch_size, validate=_between(1, 4096)),
        gpu_batch_wait_ms=env.int(
            "GPU_BATCH_WAIT_MS", defaults.gpu_batch_wait_ms, validate=_between(0, 10_000)
        ),
        torch_threads=env.int("TORCH_THREADS", defaults.torch_threads, validate=_between(1, 1024)),
        cpu_concurrency=env.int("CPU_CONCURRENCY", defaults.cpu_concurrency, validate=_between(1, 1024)),
        allowed_media_domains=tuple(_clean(env.list("ALLOWED_MEDIA_DOMAINS", []))),
        outbound_allow_networks=tuple(_clean(env.list("OUTBOUND_ALLOW_NETWORKS", []))),
        outbound_allowed_ports=tuple(env.list("OUTBOUND_ALLOWED_PORTS", [80, 443], subcast=int)),
        media_root=env.path("MEDIA_ROOT", None),
        media_max_bytes=env.int("MEDIA_MAX_BYTES", defaults.media_max_bytes, validate=_between(1, 2**34)),
        fetch_connect_timeout=env.float("FETCH_CONNECT_TIMEOUT", defaults.fetch_connect_timeout),
        fetch_timeout=env.float("FETCH_TIMEOUT", defaults.fetch_timeout),
        mm_cache_bytes=env.int("MM_CACHE_BYTES", defaults.mm_cache_bytes, validate=_between(0, 2**40)),
        transport=env.str("TRANSPORT", "auto", validate=_one_of("auto", "inline", "shm", "cuda_ipc")),
        shm_pool_bytes=env.int("SHM_POOL_BYTES", defaults.shm_pool_bytes, validate=_between(1024, 2**40)),
        webhook_secrets=tuple(_clean(env.list("WEBHOOK_SECRETS", []))),
        webhook_retry_schedule=tuple(
            env.list("WEBHOOK_RETRY_SCHEDULE", list(defaults.webhook_retry_schedule), subcast=float)
        ),
        key_webhooks=env.dict("KEY_WEBHOOKS", {}),
        batch_max_lines=env.int("BATCH_MAX_LINES", defaults.batch_max_lines, validate=_between(1, 10**7)),
        batch_max_bytes=env.int("BATCH_MAX_BYTES", defaults.batch_max_bytes, validate=_between(1, 2**40)),
        log_level=env.str("LOG_LEVEL", "INFO", validate=_one_of("DEBUG", "INFO", "WARNING", "ERROR")),
    )
    try:
        env.seal()
    except EnvError as exc:
        raise SettingsError(f"invalid settings: {exc}") from None
    settings = Settings(**values)
    _check_consistency(settings)
    return settings


def _check_consistency(s: Settings) -> None:
    problems = []
    if s.visibility_timeout <= s.task_time_limit:
        problems.append(
            "ROLLOUT_VISIBILITY_TIMEOUT must exceed ROLLOUT_TASK_TIME_LIMIT (or a running job is redelivered)"
        )
    if s.task_soft_time_limit >= s.task_time_limit:
        problems.append("ROLLOUT_TASK_SOFT_TIME_LIMIT must be below ROLLOUT_TASK_TIME_LIMIT")
    for net in s.outbound_allow_networks:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            problems.append(f"ROLLOUT_OUTBOUND_ALLOW_NETWORKS: {net!r} is not a CIDR network")
    if s.redis_url and not s.redis_url.startswith(("redis://", "rediss://", "redis+socket://", "unix://")):
        problems.append("ROLLOUT_REDIS_URL must start with redis://, rediss://, redis+socket:// or unix://")
    for secret in s.webhook_secrets:
        if not secret.startswith("whsec_"):
            problems.append("ROLLOUT_WEBHOOK_SECRETS: each secret must start with whsec_")
    if problems:
        raise SettingsError("invalid settings: " + "; ".join(problems))


def _clean(items: list[str]) -> list[str]:
    # environs does not strip blanks around list items.
    return [item.strip() for item in items if item.strip()]


def _one_of(*choices: str):
    def check(value: str) -> None:
        if value not in choices:
            from marshmallow import ValidationError

            raise ValidationError(f"must be one of {', '.join(choices)}")

    return check


def _between(low: int, high: int):
    def check(value: int) -> None:
        if not low <= value <= high:
            from marshmallow import ValidationError

            raise ValidationError(f"must be between {low} and {high}")

    return check


def _node_id(value: str) -> None:
    from marshmallow import ValidationError

    if not value or not all(c.isalnum() or c in "-_." for c in value):
        raise ValidationError("must be letters, digits, '-', '_' or '.'")
