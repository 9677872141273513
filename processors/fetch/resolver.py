"""Turning a host name into addresses, once per hop."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from .deadline import Deadline
from .errors import MediaFetchError, MediaRejectedError, MediaTimeoutError

Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    """All addresses the system resolver gives for ``host``, in its order, without duplicates.

    getaddrinfo also reads numeric spellings ("2130706433", "0x7f.1", "0177.0.0.1", "127.1") the
    way the C library would connect to them, so those are judged by the address they denote.
    It has no timeout of its own; the system resolver's (resolv.conf) applies.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def resolve(resolver: Resolver, host: str, port: int, deadline: Deadline | None = None) -> list[str]:
    """The addresses of ``host``; within ``deadline`` when given (DNS counts inside the budget).

    getaddrinfo cannot be interrupted, so the lookup runs in a thread of its own and we stop
    waiting for it when the deadline passes. The abandoned thread ends when the system resolver
    gives up (its own resolv.conf timeout); it holds no socket of ours. A daemon thread rather
    than a pool: a pool's workers stuck on a dead name server would stall every later lookup.
    """
    if deadline is None:
        return _resolve_now(resolver, host, port)
    outcome: list = []
    done = threading.Event()

    def lookup() -> None:
        try:
            outcome.append(_resolve_now(resolver, host, port))
        except BaseException as exc:  # handed to the waiting caller, raised there
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=lookup, name="media-dns", daemon=True).start()
    if not done.wait(deadline.remaining()) or deadline.expired:
        raise MediaTimeoutError("resolving the media host ran past the fetch deadline")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _resolve_now(resolver: Resolver, host: str, port: int) -> list[str]:
    try:
        return list(resolver(host, port))
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_NONAME:
            raise MediaRejectedError("the media host name does not resolve") from exc
        raise MediaFetchError("the media host name could not be resolved") from exc
    except OSError as exc:
        raise MediaFetchError("the media host name could not be resolved") from exc
