"""Turning a host name into addresses, once per hop."""

from __future__ import annotations

import socket
from collections.abc import Callable

from .errors import MediaFetchError, MediaRejectedError

Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    """All addresses the system resolver gives for ``host``, in its order, without duplicates.

    getaddrinfo also reads numeric spellings ("2130706433", "0x7f.1", "0177.0.0.1", "127.1") the
    way the C library would connect to them, so those are judged by the address they denote.
    It has no timeout of its own; the system resolver's (resolv.conf) applies.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def resolve(resolver: Resolver, host: str, port: int) -> list[str]:
    try:
        return list(resolver(host, port))
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_NONAME:
            raise MediaRejectedError("the media host name does not resolve") from exc
        raise MediaFetchError("the media host name could not be resolved") from exc
    except OSError as exc:
        raise MediaFetchError("the media host name could not be resolved") from exc
