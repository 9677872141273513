"""Which IP addresses the fetcher may connect to.

The judgement is the ``ipaddress`` module's flags, all of them together: their exact meaning has
moved between Python releases (``is_global`` alone lets multicast and fec0::/10 through), so no
single flag is trusted. IPv6 forms that carry an IPv4 address are judged by that address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from .errors import MediaBlockedError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# RFC 6052 well-known NAT64 prefix: the last 32 bits are the IPv4 destination. ipaddress has no
# property for it (it has ipv4_mapped, sixtofour and teredo), hence this one by hand.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def embedded_ipv4(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address carries (mapped, 6to4, Teredo, NAT64), if any."""
    if ip.ipv4_mapped is not None:
        return (ip.ipv4_mapped,)
    if ip.sixtofour is not None:
        return (ip.sixtofour,)
    if ip.teredo is not None:
        return ip.teredo  # (server, client): both are reached through it
    if ip in _NAT64:
        return (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF),)
    return ()


def is_public(ip: IPAddress) -> bool:
    """Whether ``ip`` is a public unicast address, judging embedded IPv4 where there is one."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = embedded_ipv4(ip)
        if inner:
            return all(is_public(v4) for v4 in inner)
        if ip.is_site_local:
            return False
    return ip.is_global and not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def is_permitted(ip: IPAddress, networks: Iterable[IPNetwork]) -> bool:
    """Public, or inside one of the operator's explicitly allowed networks."""
    candidates = [ip]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        candidates.append(ip.ipv4_mapped)
    for net in networks:
        if any(c.version == net.version and c in net for c in candidates):
            return True
    return is_public(ip)


def check_addresses(addresses: Sequence[str], networks: Iterable[IPNetwork]) -> list[IPAddress]:
    """Every address must be permitted: one bad answer refuses the host (no "try the next")."""
    networks = tuple(networks)
    checked = []
    for text in addresses:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            raise MediaBlockedError(
                "the media host resolved to an invalid address", reason="address"
            ) from None
        if not is_permitted(ip, networks):
            # The address itself stays out of the message: it may describe the internal network.
            raise MediaBlockedError(
                "the media host resolves to an address that may not be fetched from", reason="address"
            )
        checked.append(ip)
    if not checked:
        raise MediaBlockedError("the media host resolved to no address", reason="address")
    return checked
