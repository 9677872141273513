"""Session-wide test infrastructure: an isolated Redis, tiny models, real Celery workers.

Nothing here talks to a Redis the developer may already run: every session starts its own on a
free loopback port. Torch runs one thread per process (two threads on two cores can make
generation ten times slower).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "stack", "stress")
# Directories that are wholly one tier; anywhere else a test is ``unit`` unless its module says
# ``pytestmark = pytest.mark.stack`` (README "Tests").
TIER_OF_DIRECTORY = {"e2e": "stack", "stress": "stress"}
# Fixtures that start a stack: a ``unit`` test asking for one is in the wrong tier.
STACK_FIXTURES = frozenset({"stack", "stack_env"})


def tier_of(path: Path, marked: set[str], fixtures: set[str]) -> str:
    """The one tier of a test at ``path`` whose own markers include ``marked`` (a TierError names
    what is wrong when it would be in none or several)."""
    marked = marked & set(TIERS)
    if len(marked) > 1:
        raise TierError(f"in tiers {sorted(marked)}; a test is in exactly one of {TIERS}")
    relative = path.resolve().relative_to(TESTS).parts
    tier = next(iter(marked), TIER_OF_DIRECTORY.get(relative[0], "unit") if len(relative) > 1 else "unit")
    if tier == "unit" and fixtures & STACK_FIXTURES:
        raise TierError(f"uses {sorted(fixtures & STACK_FIXTURES)} but is in the unit tier; mark it stack")
    return tier


class TierError(Exception):
    pass


@pytest.hookimpl(tryfirst=True)  # before ``-m unit`` deselects by the markers given here
def pytest_collection_modifyitems(config, items):
    wrong = []
    for item in items:
        try:
            tier = tier_of(item.path, {mark.name for mark in item.iter_markers()}, set(item.fixturenames))
        except TierError as error:
            wrong.append(f"{item.nodeid}: {error}")
            continue
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
    if wrong:
        raise pytest.UsageError("tests outside one tier:\n" + "\n".join(wrong))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not tests/workers/gpu/'s name
            item.add_marker(skip)


# What one xdist process running stack files peaks at, Redis and its workers included (17 GB for
# three on the 2-core development machine).
MEMORY_PER_PROCESS = 6 * 2**30


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one process per core and one more, since stack files spend much of their time
    waiting on kills, restarts and time limits, as many as memory holds."""
    cores = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores + 1, memory // MEMORY_PER_PROCESS))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from domain.infra.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), persistent=False).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


def db_url(url: str, db: int) -> str:
    """The same Redis, another database: test groups that run workers must not see each other's
    queues (db 1: the end-to-end stack, 2: API tests, 3: batch store, 4: fuzzing, 5: webhooks,
    6: handles, 7: transport, 8: follow-ups, 9: preprocess time limit, 10: the API under gunicorn,
    11: GPU isolation, 12: job store, 13: job ends, 14: GPU batching, 15: the media stack,
    16: weight sync, 17, 18: the fidelity routes and 17 the agent routes (stacks in turn), 19: slow clients, 20: a GPU worker's death,
    21: held messages, 22: heartbeats, 23: Redis plumbing (pipelined scripts, bulk acks, the Celery app),
    31: the model check, 24: job events, 25: streams
    under gunicorn, 26: the job reaper, 27: the webhook reaper, 28: runtimes, 29: the batch reaper,
    30: worker start; the embedded Redis has 32)."""
    return url.rsplit("/", 1)[0] + f"/{db}"


def empty_db_url(url: str, db: int) -> str:
    """``db_url``, with the database emptied first."""
    target = db_url(url, db)
    with redis.Redis.from_url(target) as client:
        client.flushdb()
    return target


@pytest.fixture
def redis_client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    from engine.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("models") / "demo-qwen2-vl")
