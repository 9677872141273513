"""Where Redis is: one URL every process passes around, for a single server or a Sentinel-watched
primary.

A Sentinel target is written ``redis+sentinel://host:port,host:port/<master name>/<db>`` (the
``ROLLOUT_REDIS_SENTINELS`` and ``ROLLOUT_REDIS_SENTINEL_MASTER`` settings build it). redis-py
has no URL form for Sentinel, and kombu's (``sentinel://h:p;sentinel://h:p`` with ``master_name``
in the transport options) names no master, so this module is the one place that reads ours and
hands each library its own: :func:`domain.infra.redis_client.connect` a client of
``Sentinel.master_for`` (it asks the sentinels for the primary on every new connection, and
drops a connection that meets a demoted primary, ``READONLY``, to ask again), and
:func:`broker_options` Celery's broker URL and transport options.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0


def sentinel_url(sentinels: tuple[str, ...], master: str, db: int = 0) -> str:
    """The URL of ``master`` as the sentinels ``host:port`` know it."""
    return f"{SENTINEL_SCHEME}://{','.join(sentinels)}/{master}/{db}"


def parse_sentinel_url(url: str) -> SentinelTarget | None:
    """The Sentinel target ``url`` names; None for any other Redis URL. Raises ValueError on a
    malformed one."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    path = [p for p in parts.path.split("/") if p]
    if not parts.netloc or not 1 <= len(path) <= 2:
        raise ValueError(f"{url!r}: expected {SENTINEL_SCHEME}://host:port[,host:port...]/<master>[/<db>]")
    sentinels = []
    for address in parts.netloc.split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{url!r}: sentinel {address!r} is not host:port")
        sentinels.append((host, int(port)))
    db = path[1] if len(path) == 2 else "0"
    if not db.isdigit():
        raise ValueError(f"{url!r}: database {db!r} is not a number")
    return SentinelTarget(tuple(sentinels), path[0], int(db))


def broker_options(url: str) -> tuple[str, dict]:
    """Celery's broker URL for ``url`` and the transport options it needs beyond ours."""
    target = parse_sentinel_url(url)
    if target is None:
        return url, {}
    broker = ";".join(f"sentinel://{host}:{port}/{target.db}" for host, port in target.sentinels)
    return broker, {"master_name": target.master, "sentinel_kwargs": {"socket_timeout": 2}}
