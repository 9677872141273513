"""What the guarded fetcher may reach, and how much of it it may read."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MediaBlockedError
from .urls import normalize_host

MIB = 1024 * 1024


@dataclass(frozen=True)
class FetchPolicy:
    # Exact host names and "*.suffix" wildcards (a wildcard does not match the bare suffix).
    # Empty means any host whose addresses are public.
    allowed_domains: tuple[str, ...] = ()
    # CIDRs that may be reached although they are loopback/private/...: the only way to reach them.
    # They lift the address check only; the port and domain checks still apply.
    allow_networks: tuple[str, ...] = ()
    allowed_ports: tuple[int, ...] = (80, 443)
    # file: URLs are served only from inside this directory; None refuses every file: URL.
    media_root: Path | None = None
    max_bytes: int = 64 * MIB
    connect_timeout: float = 5.0
    # Deadline of one fetch()/post() call as a whole: DNS answers, connects, redirects, retries,
    # headers and body. A server that drips bytes cannot hold a worker past it.
    total_timeout: float = 30.0
    max_redirects: int = 5
    # Extra attempts of fetch() after a transient failure (5xx, timeout, connection error).
    retries: int = 2
    # Cap on the decoded bytes of a data: URL; None means max_bytes.
    max_data_url_bytes: int | None = None
    # CA bundle for https; None means certifi's bundle (what requests uses).
    ca_certs: Path | None = None

    # Parsed forms, filled in by __post_init__ so that a bad policy fails at start, not per fetch.
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = field(
        init=False, repr=False, compare=False
    )
    domain_patterns: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        networks = tuple(ipaddress.ip_network(cidr, strict=False) for cidr in self.allow_networks)
        patterns = []
        for entry in self.allowed_domains:
            wildcard = entry.startswith("*.")
            try:
                name = normalize_host(entry[2:] if wildcard else entry)
            except MediaBlockedError:
                raise ValueError(f"allowed_domains: {entry!r} is not a valid host name") from None
            patterns.append(f"*.{name}" if wildcard else name)
        for port in self.allowed_ports:
            if not 0 < port < 65536:
                raise ValueError(f"allowed_ports: {port} is not a TCP port")
        if self.max_bytes <= 0 or self.total_timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError("max_bytes, connect_timeout and total_timeout must be positive")
        if self.max_redirects < 0 or self.retries < 0:
            raise ValueError("max_redirects and retries must not be negative")
        # object.__setattr__: the documented way to set derived fields of a frozen dataclass.
        object.__setattr__(self, "networks", networks)
        object.__setattr__(self, "domain_patterns", tuple(patterns))
        if self.max_data_url_bytes is None:
            object.__setattr__(self, "max_data_url_bytes", self.max_bytes)
        if self.media_root is not None:
            object.__setattr__(self, "media_root", Path(self.media_root).resolve())

    def allows_domain(self, host: str) -> bool:
        """Whether a normalized host name passes allowed_domains (always, when it is empty)."""
        if not self.domain_patterns:
            return True
        for pattern in self.domain_patterns:
            if pattern.startswith("*."):
                if host.endswith(pattern[1:]):
                    return True
            elif host == pattern:
                return True
        return False


def log_policy_warnings(policy: FetchPolicy, logger: logging.Logger) -> None:
    """Log, once at service start, what the policy opens up that an operator may not expect."""
    if not policy.allowed_domains:
        logger.warning(
            "media fetch policy: allowed_domains is empty, so requests may make this service "
            "fetch from any public host; set allowed_domains to restrict it"
        )
    if policy.allow_networks:
        logger.warning(
            "media fetch policy: allow_networks lets requests reach otherwise refused addresses "
            "in %s (ports %s)",
            ", ".join(policy.allow_networks),
            ", ".join(str(p) for p in policy.allowed_ports),
        )
    if policy.media_root is not None:
        logger.info("media fetch policy: file: URLs are served from %s", policy.media_root)
