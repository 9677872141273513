"""Result reservations (domain/infra/redis_reservations.py) on a real embedded Redis with a bound:
all of a call's or none, checked against used memory as Redis reads it and what is reserved; a
job's end releases its reservation in the script that ends it; a reservation with no job lapses."""

from __future__ import annotations

import pytest
import redis

from domain.infra.redis_memory import read_memory
from domain.infra.redis_reservations import BYTES_KEY, UNTIL_KEY, Reservations
from domain.infra.redis_server import EmbeddedRedis
from domain.infra.store_errors import StoreFull
from domain.jobs.store import JobStore, StoreLimits
from tests.domain.infra.test_redis_memory import MIB, bounded_redis  # noqa: F401 (a fixture)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def room(client: redis.Redis) -> int:
    """What is left below the high-water mark, beside what is reserved."""
    use = read_memory(client)
    return use.high_water_bytes - use.used_bytes - use.reserved_bytes


def test_a_call_reserves_all_its_jobs_or_none(bounded_redis):  # noqa: F811
    reservations = Reservations(bounded_redis)
    free = room(bounded_redis)
    reservations.reserve([("job_a", free // 2), ("job_b", free // 4)])
    assert reservations.reserved_bytes() == free // 2 + free // 4
    with pytest.raises(StoreFull) as refused:
        reservations.reserve([("job_c", free // 8), ("job_d", free // 4)])  # together they do not fit
    assert refused.value.errors["asked_bytes"] == free // 8 + free // 4
    assert refused.value.errors["reserved_bytes"] == free // 2 + free // 4
    assert refused.value.headers["Retry-After"] == "60"
    assert bounded_redis.hkeys(BYTES_KEY) == [b"job_a", b"job_b"]
    reservations.reserve([("job_c", free // 8)])  # alone it does
    reservations.release(["job_a", "job_a", "job_x"])  # twice, or never reserved: nothing more
    assert reservations.reserved_bytes() == free // 4 + free // 8
    assert read_memory(bounded_redis).reserved_bytes == reservations.reserved_bytes()


def test_reservations_without_a_job_lapse(bounded_redis):  # noqa: F811
    clock = Clock()
    reservations = Reservations(bounded_redis, lifetime=60, clock=clock)
    reservations.reserve([("job_lost", room(bounded_redis) - 50_000)])  # the API died before making it
    with pytest.raises(StoreFull):
        reservations.reserve([("job_next", 100_000)])
    clock.now += 61
    reservations.reserve([("job_next", 100_000)])
    assert reservations.reserved_bytes() == 100_000 and bounded_redis.zrange(UNTIL_KEY, 0, -1) == [b"job_next"]


def test_an_unbounded_redis_takes_every_reservation(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", persistent=False, maxmemory=0).start()
    try:
        reservations = Reservations(redis.Redis.from_url(server.url))
        reservations.reserve([("job_a", 10**12)])
        assert reservations.reserved_bytes() == 10**12
    finally:
        server.stop()


@pytest.mark.parametrize("end", ["succeeded", "failed", "cancelled"])
def test_a_jobs_end_releases_its_reservation_in_the_same_script(bounded_redis, end):  # noqa: F811
    store = JobStore(bounded_redis, StoreLimits(max_active_per_owner=10, max_active_total=10, result_ttl=60))
    job = store.create(owner="key-a", kind="generate", request={}, request_id=None)
    other = store.create(owner="key-a", kind="generate", request={}, request_id=None)
    reservations = Reservations(bounded_redis)
    reservations.reserve([(job["id"], 5000), (other["id"], 7000)])
    assert store.advance(job["id"], "generating")
    assert reservations.reserved_bytes() == 12_000  # running: still reserved
    assert store.advance(job["id"], end, result={"choices": []})
    assert reservations.reserved_bytes() == 7000 and bounded_redis.hkeys(BYTES_KEY) == [other["id"].encode()]
    assert not store.advance(job["id"], "succeeded") and reservations.reserved_bytes() == 7000
    assert MIB  # the bound the fixture's Redis has (8 MiB)
