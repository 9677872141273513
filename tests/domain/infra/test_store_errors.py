"""The store's failures classified in the domain's terms: a Redis error is a typed 503 with a code."""

from __future__ import annotations

import pytest
import redis

from domain.error_statuses import http_status
from domain.infra.redis_server import free_port
from domain.infra.store_errors import StoreFull, StoreUnavailable, store_error


def test_redis_away_is_store_unavailable_a_503_with_a_retry_after():
    with pytest.raises(redis.ConnectionError) as away:
        redis.Redis(port=free_port(), socket_connect_timeout=0.2).ping()
    failure = store_error(away.value)
    assert isinstance(failure, StoreUnavailable) and failure.code == "redis_unavailable"
    assert http_status(failure) == 503 and failure.headers["Retry-After"] == "2"


def test_a_wrapped_redis_error_is_classified_by_its_cause():
    try:
        try:
            raise redis.TimeoutError("timed out")
        except redis.TimeoutError as cause:
            raise RuntimeError("could not publish") from cause  # as kombu wraps it
    except RuntimeError as wrapped:
        assert isinstance(store_error(wrapped), StoreUnavailable)


def test_anything_else_is_no_store_error_and_a_typed_one_stays_itself():
    assert store_error(ValueError("not the store")) is None
    full = StoreFull("full")
    assert store_error(full) is full and http_status(full) == 503
