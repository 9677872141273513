"""docker-compose.yml and the Dockerfile: every command they run exists in the CLI, and the settings
they give load. Parsed statically (no Docker needed); ``docker compose config`` runs when available."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from domain.infra.heartbeats import WORKER_KINDS
from domain.settings import load_settings
from launcher.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
# What `docker compose up` needs set (the file refuses to start without them).
REQUIRED_ENV = {"ROLLOUT_API_KEYS": "key-one,key-two", "FLOWER_BASIC_AUTH": "admin:secret"}
_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def ours(compose: dict) -> dict[str, dict]:
    """The services that run our image."""
    return {name: service for name, service in compose["services"].items() if service.get("build") == "."}


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}``."""

    def one(match: re.Match) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if env.get(name):
            return env[name]
        if op == ":?":
            raise AssertionError(f"{name} is required: {arg}")
        return arg if op == ":-" else ""

    return _VARIABLE.sub(one, value)


def test_one_node_has_every_part(compose):
    services = {name: s for name, s in compose["services"].items() if not s.get("profiles")}
    assert set(services) == {"redis", "api", "cpu-worker", "gpu-worker", "webhooks-worker", "batches-worker",
                             "flower"}
    redis_command = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_command and "--maxmemory-policy noeviction" in redis_command
    [device] = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "flower" in services["flower"]["command"]
    broker = next(arg.split("=", 1)[1] for arg in services["flower"]["command"] if arg.startswith("--broker="))
    assert {interpolate(s["environment"]["ROLLOUT_REDIS_URL"], {}) for s in ours(compose).values()} == {broker}
    assert set(ours(compose)) == set(services) - {"redis", "flower"}


def test_the_sentinel_profile_watches_redis_with_a_replica_and_three_sentinels(compose):
    profiled = {name: s for name, s in compose["services"].items() if "sentinel" in s.get("profiles", ())}
    assert set(profiled) == {"redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"}
    assert "--replicaof redis 6379" in " ".join(profiled["redis-replica"]["command"])
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        script = profiled[name]["command"][-1]
        assert "sentinel monitor rollout redis 6379 2" in script and "--sentinel" in script
    # What the README tells the workers to use with the profile parses as a Sentinel target.
    from domain.redis_target import parse_sentinel_url

    target = parse_sentinel_url("redis+sentinel://sentinel-1:26379,sentinel-2:26379,sentinel-3:26379/rollout/0")
    assert target.master == "rollout" and len(target.sentinels) == 3


def test_every_command_exists_in_the_cli(compose):
    parser = build_parser()
    ran = []
    for name, service in ours(compose).items():
        try:
            args = parser.parse_args(service["command"])
        except SystemExit:
            pytest.fail(f"service {name}: `rollout-queue {' '.join(service['command'])}` is not a CLI command")
        ran.append((args.command, getattr(args, "kind", None)))
    assert sorted(ran, key=str) == sorted([("api", None)] + [("worker", kind) for kind in WORKER_KINDS], key=str)


def test_the_image_runs_the_cli_and_installs_every_package():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    [entrypoint] = re.findall(r"^ENTRYPOINT (.+)$", text, re.M)
    assert json.loads(entrypoint) == ["rollout-queue"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["rollout-queue"] == "launcher.cli:main"
    copied = {Path(source).name for line in re.findall(r"^COPY .+$", text, re.M) for source in line.split()[1:-1]}
    packages = {pattern.rstrip("*") for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"packages the image would leave out: {packages - copied}"
    assert {"pyproject.toml", "README.md", "python"} <= copied  # pip install . needs both, and the client
    assert re.search(r"^RUN pip install \./clients/python \.$", text, re.M)  # the client the service depends on
    assert "torch==2.13.0" in text  # the project's pin, installed first in its own layer


def test_every_service_loads_its_settings_and_one_node_shares_its_id(compose, monkeypatch):
    loaded = {}
    for name, service in ours(compose).items():
        for key, value in service["environment"].items():
            monkeypatch.setenv(key, interpolate(str(value), REQUIRED_ENV))
        loaded[name] = load_settings()
        for key in service["environment"]:
            monkeypatch.delenv(key)
    # Handles are routed to generate.<node id>: the CPU and GPU workers of a node must agree on it.
    assert len({settings.node_id for settings in loaded.values()}) == 1
    assert loaded["api"].api_keys == ("key-one", "key-two")
    assert loaded["gpu-worker"].model is None  # empty ROLLOUT_MODEL: the demo model
    assert all(settings.task_events for settings in loaded.values())  # what Flower's task views show
    # shm handles name segments in the producer's /dev/shm: the CPU worker joins the GPU worker's.
    services = compose["services"]
    assert services["cpu-worker"]["ipc"] == "service:gpu-worker" and services["gpu-worker"]["ipc"] == "shareable"


def test_required_secrets_are_enforced(compose):
    env = ours(compose)["api"]["environment"]
    with pytest.raises(AssertionError, match="ROLLOUT_API_KEYS is required"):
        interpolate(env["ROLLOUT_API_KEYS"], {})
    with pytest.raises(AssertionError, match="FLOWER_BASIC_AUTH is required"):
        interpolate(compose["services"]["flower"]["environment"]["FLOWER_BASIC_AUTH"], {})


def _docker_compose() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.mark.skipif(_docker_compose() is None, reason="needs the docker compose plugin")
def test_docker_compose_accepts_the_file():
    result = subprocess.run([*_docker_compose(), "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                            text=True, env={"PATH": "/usr/bin:/bin:/usr/local/bin", **REQUIRED_ENV})
    assert result.returncode == 0, result.stderr
