"""The job event stream tests' Redis (database 24), job store and event streams."""

from __future__ import annotations

import pytest
import redis

from domain.jobs.events import JobEvents
from domain.jobs.store import JobStore, StoreLimits
from tests.conftest import empty_db_url


@pytest.fixture
def client(redis_url):
    client = redis.Redis.from_url(empty_db_url(redis_url, 24))
    yield client
    client.close()


@pytest.fixture
def jobs(client):
    return JobStore(client, StoreLimits(100, 100, 600))


@pytest.fixture
def events(client):
    return JobEvents(client, ttl=600)
