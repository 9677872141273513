"""Redis clients with the timeouts and retries the service wants, to a single server or to the
primary a set of sentinels names (:mod:`domain.redis_target`)."""

from __future__ import annotations

import redis
from kombu.exceptions import OperationalError
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from domain.redis_target import parse_sentinel_url

# What a task sees while Redis is down or restarting (BusyLoadingError is a ConnectionError), from
# our clients or from Celery publishing a message: not the job's fault, the store is away. A
# failover reads the same: no primary is known until the sentinels promote one.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OperationalError)


def _options() -> dict:
    # Short timeouts: the API answers 503 quickly while Redis is down instead of hanging, and the
    # client reconnects by itself once Redis is back (or the sentinels name the new primary).
    return {
        "socket_connect_timeout": 2,
        "socket_timeout": 10,
        "health_check_interval": 15,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
    }


def connect(url: str) -> redis.Redis:
    target = parse_sentinel_url(url)
    if target is None:
        return redis.Redis.from_url(url, **_options())
    sentinels = Sentinel(list(target.sentinels), sentinel_kwargs={"socket_connect_timeout": 2, "socket_timeout": 2})
    return sentinels.master_for(target.master, db=target.db, **_options())


def with_pool_size(client: redis.Redis, connections: int) -> redis.Redis:
    """A client to the same Redis, with the same options, on a pool of its own of ``connections``
    (redis-py's pools hold at most 100 by default): blocking stream reads each hold a connection
    for their wait, and must neither run out nor take the connections of ordinary calls."""
    pool = client.connection_pool
    kwargs = {name: value for name, value in pool.connection_kwargs.items() if name != "connection_pool"}
    if isinstance(pool, SentinelConnectionPool):
        return redis.Redis(connection_pool=SentinelConnectionPool(
            pool.service_name, pool.sentinel_manager, is_master=True, check_connection=pool.check_connection,
            max_connections=connections, **kwargs))
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class,
                                                            max_connections=connections, **kwargs))
