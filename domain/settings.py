"""Settings: the only module that reads the environment.

Entry points call :func:`load_settings` once and pass the frozen :class:`Settings` down. Every
variable has the prefix ``ROLLOUT_``; all bad values are reported together, each naming its variable.
Tests build ``Settings(...)`` directly instead of touching the environment.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from environs import Env, EnvError

from domain.names import node_generate_queue
from domain.redis_target import SENTINEL_SCHEME, parse_sentinel_url, sentinel_url
from engine.errors import InvalidRequestError


class SettingsError(InvalidRequestError):
    code = "invalid_settings"


def between(default: Any, low: float, high: float) -> Any:
    """A setting whose value must lie in ``low..high`` (checked when read from the environment)."""
    return field(default=default, metadata={"between": (low, high)})


def one_of(default: str, choices: tuple[str, ...]) -> Any:
    """A setting that takes one of ``choices``."""
    return field(default=default, metadata={"one_of": choices})


def _default_state_dir() -> Path:
    return Path.home() / ".rollout-queue"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow),
    not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call on this platform (macOS)
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Settings:
    redis_url: str | None = None
    # Redis behind Sentinel (domain/redis_target.py): the sentinels' host:port and the name
    # they monitor the primary by. Every process then follows a failover; ROLLOUT_REDIS_URL unset.
    redis_sentinels: tuple[str, ...] = ()
    redis_sentinel_master: str = "rollout"
    # With replicas: the API answers 202 only once this many replicas hold the job (Redis WAIT),
    # else 503 not_durable; 0 answers at once (replication is asynchronous: a failover may then
    # lose the last jobs answered).
    redis_replica_acks: int = between(0, 0, 16)
    redis_replica_timeout_ms: int = between(1000, 1, 600_000)
    # `rollout-queue up` without ROLLOUT_REDIS_URL: one embedded redis-server ("single"), or a
    # primary, replicas and three sentinels on loopback ("sentinel") to try a failover.
    embedded_redis: str = one_of("single", ("single", "sentinel"))
    # The "sentinel" topology's replicas: two, so one is left to confirm writes after a failover
    # (ROLLOUT_REDIS_REPLICA_ACKS=1 refused every submit until the old primary came back with one).
    embedded_redis_replicas: int = between(2, 1, 8)
    # The embedded Redis' append-only file (no ROLLOUT_REDIS_URL): "everysec" may lose the last
    # second of writes (jobs answered 202 among them) when the machine dies; "always" fsyncs every
    # write first (domain/infra/redis_server.py; the cost is in bench/durability.py).
    redis_fsync: str = one_of("everysec", ("everysec", "always"))
    # The embedded Redis' maxmemory, in bytes (noeviction: at the bound it refuses writes, and the
    # API refuses new work at 90 % of it, domain/infra/redis_memory.py). None: a quarter of the
    # machine's memory, computed at start; 0: no bound. Your own Redis (ROLLOUT_REDIS_URL) has its own.
    redis_maxmemory_bytes: int | None = between(None, 0, 2**50)
    state_dir: Path = field(default_factory=_default_state_dir)
    model: str | None = None
    device: str = one_of("auto", ("auto", "cpu", "cuda"))
    dtype: str = one_of("auto", ("auto", "float32", "bfloat16", "float16"))
    weight_version: str | None = None
    api_keys: tuple[str, ...] = ()
    # Keys that may update weights and pause generation (they are API keys too). None configured
    # and no API keys either: the open demo, where anyone may (a warning says so at start).
    admin_keys: tuple[str, ...] = ()
    # Weight updates read model directories under this root only; None: weight updates are off.
    weights_root: Path | None = None
    # How long POST /v1/weights waits for every live GPU worker to serve the new weights.
    weights_update_timeout: float = between(300.0, 0, 3600)
    # LoRA adapters (engine/lora/, README "Adapters"): resident on each GPU worker at most, their
    # largest rank, and loaded per key (an admin key's are shared and not counted).
    max_loras: int = between(8, 1, 256)
    max_cpu_loras: int = between(32, 1, 4096)  # loaded on each GPU worker, the rest of them on the CPU
    max_lora_rank: int = between(64, 1, 1024)
    max_loras_per_key: int = between(4, 0, 256)
    host: str = "127.0.0.1"
    port: int = between(8000, 1, 65535)
    api_workers: int = between(2, 1, 64)
    node_id: str = field(default_factory=socket.gethostname)
    result_ttl: int = between(7 * 24 * 3600, 1, 10**9)  # seconds: tests expire results in a few
    default_max_tokens: int = between(64, 1, 10**6)
    max_model_len: int | None = between(None, 1, 10**8)
    max_body_bytes: int = between(32 * 1024 * 1024, 1024, 2**34)
    max_content_parts: int = between(16, 0, 1024)
    max_metadata_bytes: int = between(4096, 0, 2**20)
    # One job's result at the most (engine/result_bound.py, counted at submit: 422 result_too_large).
    max_result_bytes: int = between(32 * 1024 * 1024, 64 * 1024, 2**34)
    max_queued_per_key: int = between(10_000, 1, 10**9)
    max_queued_total: int = between(100_000, 1, 10**9)
    sync_timeout_max: float = between(300.0, 0, 3600)
    # Streaming (domain/jobs/events.py, web/api/streams.py): each gunicorn worker serves up to
    # api_stream_slots SSE streams at once, on threads beside api_threads for everything else
    # (web/serving/server.py says why threads); an idle stream gets a keep-alive comment this often; a job's
    # event stream keeps about stream_events_maxlen entries (one per flush of its tokens).
    api_threads: int = between(16, 1, 1024)
    # A whole request must arrive within this (plus a second per 256 KiB of body), or it is
    # dropped with a 408 (web/serving/request_buffering.py).
    request_read_timeout: float = between(10.0, 0.1, 3600)
    # A connection that sends nothing this long is closed; one peer (an address) holds at most
    # api_connections_per_peer connections of an API worker, more are closed as accepted
    # (web/serving/request_buffering.py): silent sockets never fill the worker's connections.
    request_first_byte_timeout: float = between(5.0, 0.1, 3600)
    api_connections_per_peer: int = between(512, 1, 100_000)
    api_stream_slots: int = between(256, 0, 10_000)
    # Of those, one key holds at most this many (None: three quarters, so other keys keep a share);
    # a reader that stops reading is dropped once a write to it waits stream_write_timeout seconds.
    # How long an idle keep-alive connection stays open (web/serving/server.py says why 120).
    api_keepalive_seconds: int = between(120, 1, 3600)
    api_stream_slots_per_key: int | None = between(None, 1, 10_000)
    stream_write_timeout: float = between(30.0, 0.1, 3600)
    # Below the Redis client's socket timeout (10 s): a blocking read waits at most this long.
    stream_keepalive_seconds: float = between(5.0, 0.05, 8)
    stream_events_maxlen: int = between(20_000, 100, 10**8)
    # A stream rides out Redis away for less than this (keep-alives meanwhile, then on from where
    # it was); past it a native stream ends with ``event: interrupted`` and the client resumes.
    stream_outage_seconds: float = between(30.0, 0, 3600)
    # The GPU session writes a job's new tokens at most this often (a first token and a job's end
    # at once): faster decode steps share one entry. 0: every step.
    stream_flush_ms: float = between(10.0, 0, 10_000)
    # The model name the OpenAI and vLLM dialects serve (`model` in bodies); None: the model's id.
    served_model_name: str | None = None
    # A request's own chat template (chat_template_kwargs.chat_template) runs in the API process:
    # refused unless this is set, as vLLM's --trust-request-chat-template (web/dialects/chat_template.py).
    trust_request_chat_template: bool = False
    # vLLM's --enable-return-routed-experts: on an MoE model, the vLLM and OpenAI routes return every
    # choice's routed experts unless a request sets return_routed_experts false (engine/routing/).
    return_routed_experts: bool = False
    # Which tool-call and reasoning parser reads the model's chat replies (web/parsers/), as vLLM's
    # --tool-call-parser / --reasoning-parser; auto: from the model's chat template, none: off.
    tool_call_parser: str = one_of("auto", ("auto", "none", "hermes", "mistral"))
    reasoning_parser: str = one_of("auto", ("auto", "none", "qwen3", "deepseek_r1"))
    # The built-in demo model served when ROLLOUT_MODEL is unset (domain/models.py).
    demo_model: str = one_of("demo-qwen2.5-omni", ("demo-qwen2.5-omni", "demo-qwen3", "demo-qwen3-moe"))
    # Celery time limits. The broker's visibility timeout must exceed the hard limit, or Redis
    # redelivers a message whose task is still running and the job runs twice.
    task_soft_time_limit: int = between(540, 1, 10**6)
    task_time_limit: int = between(600, 1, 10**6)
    visibility_timeout: int = between(3600, 1, 10**7)
    # A job or webhook that has not moved for this long is looked for in every queue
    # (domain/jobs/reaper.py, domain/webhooks/reaper.py); one no message carries is sent again.
    stalled_job_after: int = between(120, 1, 10**7)
    # A worker beats this often; its heartbeat lapses after five beats missed, and then what it held
    # goes back to the queues (domain/infra/heartbeats.py, workers/held_messages.py).
    heartbeat_seconds: float = between(2.0, 0.05, 60)
    task_events: bool = False
    # Rows decoding together in a GPU worker. Unset: as many rows of typical_row_tokens as the KV
    # pool holds (kv_cache_tokens // typical_row_tokens), so the batch is sized by memory.
    gpu_batch_size: int | None = between(None, 1, 4096)
    typical_row_tokens: int = between(1024, 1, 2**30)
    gpu_batch_wait_ms: int = between(20, 0, 10_000)
    # The GPU worker's continuous batch (engine.scheduler): the KV pool (in tokens, in blocks of
    # kv_block_tokens), prefill chunk, caches.
    kv_cache_tokens: int = between(131_072, 1, 2**40)
    kv_block_tokens: int = between(16, 1, 4096)
    # On CUDA: the pool takes this share of the device memory free once the model is loaded (at
    # most kv_cache_tokens); unset: kv_cache_tokens alone.
    kv_cache_memory_fraction: float | None = between(None, 0.01, 0.99)
    prefill_chunk_tokens: int = between(512, 1, 10**7)
    # While rows decode, new prompts are prefilled once they are join_ratio of the running rows, or
    # after join_wait_steps decode steps (engine.prefill_plan.hold_joins); join_ratio 0: at once.
    join_ratio: float = between(0.5, 0, 16)
    join_wait_steps: int = between(4, 0, 10_000)
    prompt_cache_tokens: int = between(4096, 0, 2**40)
    # KV blocks found again by name across requests, turns and prompt groups (engine/prefix_hash.py).
    prefix_caching: bool = True
    # Generate messages go to the GPU worker their prompt's prefix went to (domain/infra/gpu_affinity.py);
    # false: to the node's or the shared queue, whichever worker takes them.
    gpu_affinity: bool = True
    encoder_cache_bytes: int = between(256 * 1024 * 1024, 0, 2**44)
    torch_threads: int = between(1, 1, 1024)
    # The GPU worker's load-time fidelity check (engine/fidelity.py): before it takes work, its
    # generated and scored logprobs must equal the model's own forward. The tolerance in nats;
    # None: by dtype (1e-3 in fp32, 0.15 in 16-bit types).
    fidelity_check: bool = True
    fidelity_tolerance: float | None = between(None, 0, 100)
    # Fairness between keys (domain/infra/fair_share.py): a CPU worker runs this many jobs at once, and
    # one key holds at most cpu_per_key of all CPU workers' slots (None: half of cpu_concurrency, at
    # least one), so its slow media never fill them.
    # One per usable core: more processes than cores preprocess no faster and take the cores the
    # GPU worker's decode loop runs on (the rollout benchmark lost a quarter of its speed to it).
    cpu_concurrency: int = field(default_factory=usable_cores, metadata={"between": (1, 1024)})
    cpu_per_key: int | None = between(None, 1, 1024)
    render_per_key: int = between(4, 1, 1024)
    # Who may read GET /metrics (web/metrics.py): its counters move per job, so not every caller.
    metrics_allow_networks: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    # Guarded fetching (processors.fetch).
    allowed_media_domains: tuple[str, ...] = ()
    outbound_allow_networks: tuple[str, ...] = ()
    outbound_allowed_ports: tuple[int, ...] = (80, 443)
    media_root: Path | None = None
    media_max_bytes: int = between(64 * 1024 * 1024, 1, 2**34)
    fetch_connect_timeout: float = between(5.0, 0.01, 600)
    fetch_timeout: float = between(30.0, 0.01, 3600)
    fetch_retries: int = between(2, 0, 10)
    fetch_concurrency: int = between(4, 1, 64)
    max_image_pixels: int = between(40_000_000, 1, 2**34)
    # Video and audio decoding (processors.decode).
    max_video_seconds: float = between(600.0, 0.01, 86_400)
    max_video_frames: int = between(32, 1, 100_000)
    video_fps: float = between(2.0, 0.01, 240)
    max_video_pixels: int = between(1920 * 1088, 1, 2**34)
    max_audio_seconds: float = between(30.0, 0.01, 86_400)
    # Multimodal cache and feature transport.
    mm_cache_bytes: int = between(512 * 1024 * 1024, 0, 2**40)
    mm_cache_process_bytes: int = between(256 * 1024 * 1024, 0, 2**40)
    transport: str = one_of("auto", ("auto", "inline", "shm", "cuda_ipc"))
    shm_pool_bytes: int = between(1024 * 1024 * 1024, 1024, 2**40)
    handle_ack_timeout: float = between(600.0, 1, 86_400)
    # Webhooks.
    webhook_secrets: tuple[str, ...] = ()
    webhook_retry_schedule: tuple[float, ...] = (5, 30, 120, 600, 1800, 3600, 7200, 14400, 28800, 28800)
    webhook_timeout: float = between(10.0, 0.1, 600)
    webhook_concurrency: int = between(32, 1, 1024)
    webhook_per_key: int = between(8, 1, 1024)
    key_webhooks: Mapping[str, str] = field(default_factory=dict)
    # Batches.
    batch_max_lines: int = between(50_000, 1, 10**7)
    batch_max_bytes: int = between(200 * 1024 * 1024, 1, 2**40)
    # Input lines of one key's unfinished batches held in Redis, as stored (JSON): bounds the
    # memory one key's uploads can take.
    batch_max_stored_bytes_per_key: int = between(1024 * 1024 * 1024, 1, 2**42)
    batch_chunk_size: int = between(64, 1, 10_000)
    batch_completion_window: int = between(24 * 3600, 60, 10**7)
    log_level: str = one_of("INFO", ("DEBUG", "INFO", "WARNING", "ERROR"))

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)

    @property
    def redis_target(self) -> str | None:
        """The Redis every process connects to: ROLLOUT_REDIS_URL, or the sentinels' primary."""
        if self.redis_sentinels:
            return sentinel_url(self.redis_sentinels, self.redis_sentinel_master)
        return self.redis_url

    @property
    def batch_rows(self) -> int:
        """Rows decoding together: ROLLOUT_GPU_BATCH_SIZE, or as many typical rows as the KV pool holds."""
        if self.gpu_batch_size is not None:
            return self.gpu_batch_size
        return max(1, min(4096, self.kv_cache_tokens // self.typical_row_tokens))

    @property
    def cpu_key_slots(self) -> int:
        """The CPU slots one key holds at most: ROLLOUT_CPU_PER_KEY, or half of a worker's."""
        return self.cpu_per_key or max(1, self.cpu_concurrency // 2)

    @property
    def generate_queue(self) -> str:
        return node_generate_queue(self.node_id)


# Each field is read from ROLLOUT_<FIELD NAME>; its checks beyond type, range and choice, by field:
_VALIDATORS = {"node_id": lambda: _node_id}


def env_name(field_name: str) -> str:
    return "ROLLOUT_" + field_name.upper()


def load_settings() -> Settings:
    """Parse every ``ROLLOUT_*`` variable; raise one :class:`SettingsError` naming each bad one."""
    env = Env(eager=False, expand_vars=False, prefix="ROLLOUT_")
    defaults = Settings()
    values = {}
    for spec in fields(Settings):
        values[spec.name] = _read(env, spec, getattr(defaults, spec.name))
    try:
        env.seal()
    except EnvError as exc:
        raise SettingsError(f"invalid settings: {exc}") from None
    settings = Settings(**values)
    _check_consistency(settings)
    return settings


def _read(env: Env, spec: dataclasses.Field, default: Any) -> Any:
    name, type_name = spec.name, spec.type
    key = name.upper()
    validate = None
    if "one_of" in spec.metadata:
        validate = _one_of(*spec.metadata["one_of"])
    elif "between" in spec.metadata:
        validate = _between(*spec.metadata["between"])
    elif name in _VALIDATORS:
        validate = _VALIDATORS[name]()
    base = type_name.replace(" | None", (""))
    optional = type_name.endswith("| None")
    if base == "int":
        return (
            env.int(key, default, validate=validate)
            if not optional
            else env.int(key, None, validate=validate)
        )
    if base == "bool":
        return env.bool(key, default)
    if base == "float":
        return env.float(key, default, validate=validate)
    if base == "Path":
        return env.path(key, default)
    if base.startswith("tuple["):
        item = {"tuple[int, ...]": int, "tuple[float, ...]": float}.get(base, str)
        raw = env.list(key, list(default), subcast=item)
        if raw is None:  # unparsable: env.seal() reports it
            return default
        return tuple(_clean(raw) if item is str else raw)
    if base.startswith("Mapping"):
        return env.dict(key, dict(default))
    value = env.str(key, default, validate=validate)
    return (value or None) if optional else value


def _check_consistency(s: Settings) -> None:
    problems = []
    if s.visibility_timeout <= s.task_time_limit:
        problems.append(
            "ROLLOUT_VISIBILITY_TIMEOUT must exceed ROLLOUT_TASK_TIME_LIMIT (or a running job is redelivered)"
        )
    if s.task_soft_time_limit >= s.task_time_limit:
        problems.append("ROLLOUT_TASK_SOFT_TIME_LIMIT must be below ROLLOUT_TASK_TIME_LIMIT")
    for name in ("outbound_allow_networks", "metrics_allow_networks"):
        for net in getattr(s, name):
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                problems.append(f"{env_name(name)}: {net!r} is not a CIDR network")
    if s.redis_url and not s.redis_url.startswith(("redis://", "rediss://", "redis+socket://", "unix://",
                                                   f"{SENTINEL_SCHEME}://")):
        problems.append(f"ROLLOUT_REDIS_URL must start with redis://, rediss://, redis+socket://, unix:// "
                        f"or {SENTINEL_SCHEME}://")
    if s.redis_sentinels and s.redis_url:
        problems.append("set ROLLOUT_REDIS_URL or ROLLOUT_REDIS_SENTINELS, not both")
    try:
        parse_sentinel_url(s.redis_target or "")
    except ValueError as exc:
        problems.append(f"ROLLOUT_REDIS_SENTINELS / ROLLOUT_REDIS_URL: {exc}")
    if s.embedded_redis == "sentinel" and not s.redis_target and s.redis_replica_acks >= s.embedded_redis_replicas:
        problems.append("ROLLOUT_REDIS_REPLICA_ACKS must be below ROLLOUT_EMBEDDED_REDIS_REPLICAS: after a failover"
                        " one replica fewer is left to confirm writes, and every submit would be refused")
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

    if value is None:
        raise ValidationError("must not be empty")
    if not value or not all(c.isalnum() or c in "-_." for c in value):
        raise ValidationError("must be letters, digits, '-', '_' or '.'")
