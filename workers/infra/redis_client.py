"""Redis clients with the timeouts and retries the service wants."""

from __future__ import annotations

import redis
from kombu.exceptions import OperationalError
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

# What a task sees while Redis is down or restarting (BusyLoadingError is a ConnectionError), from
# our clients or from Celery publishing a message: not the job's fault, the store is away.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OperationalError)


def connect(url: str) -> redis.Redis:
    # Short timeouts: the API answers 503 quickly while Redis is down instead of hanging, and the
    # client reconnects by itself once Redis is back.
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=2,
        socket_timeout=10,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def with_pool_size(client: redis.Redis, connections: int) -> redis.Redis:
    """A client to the same Redis, with the same options, on a pool of its own of ``connections``
    (redis-py's pools hold at most 100 by default): blocking stream reads each hold a connection
    for their wait, and must neither run out nor take the connections of ordinary calls."""
    pool = client.connection_pool
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class,
                                                            max_connections=connections,
                                                            **pool.connection_kwargs))
