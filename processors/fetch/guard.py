"""The checks every HTTP hop passes before a socket is opened, and the address it is pinned to."""

from __future__ import annotations

from dataclasses import dataclass

from .addresses import check_addresses
from .deadline import Deadline
from .errors import MediaBlockedError
from .policy import FetchPolicy
from .resolver import Resolver, resolve
from .urls import ParsedURL

HTTP_SCHEMES = frozenset({"http", "https"})


@dataclass(frozen=True)
class PinnedTarget:
    url: ParsedURL
    # The checked address the connection goes to. Connecting by name would resolve again and
    # could get a different answer (DNS rebinding); connecting to this address cannot.
    address: str


def pin_http_target(url: ParsedURL, policy: FetchPolicy, resolver: Resolver,
                    deadline: Deadline | None = None) -> PinnedTarget:
    """Scheme, domain and port first (no I/O), then resolve once (within ``deadline``) and check
    every address."""
    if url.scheme not in HTTP_SCHEMES:
        raise MediaBlockedError(f"the URL scheme {url.scheme!r} is not allowed here", reason="scheme")
    if url.host is None:
        raise MediaBlockedError("the media URL has no host", reason="url")
    if not policy.allows_domain(url.host):
        raise MediaBlockedError("the media host is not in the allowed domains", reason="domain")
    assert url.port is not None  # http(s) always has a default port
    if url.port not in policy.allowed_ports:
        raise MediaBlockedError(f"port {url.port} is not an allowed port", reason="port")
    addresses = [url.host] if url.is_ip_literal else resolve(resolver, url.host, url.port, deadline)
    checked = check_addresses(addresses, policy.networks)
    return PinnedTarget(url, str(checked[0]))
