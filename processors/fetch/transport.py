"""One HTTP exchange with a pinned address, under a deadline, with a capped body read.

urllib3 directly rather than requests: requests would need a custom adapter to pin the address,
and its Session reads proxy settings from the environment unless told not to. A urllib3
connection pool created for the checked IP connects to exactly that IP, never resolves a name,
never consults a proxy, and still speaks to the original host: the Host header is set
explicitly, and for https ``server_hostname`` (SNI) and ``assert_hostname`` (certificate check)
name the host from the URL.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

import certifi
from urllib3 import HTTPConnectionPool, HTTPSConnectionPool, Timeout
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import (
    ConnectTimeoutError,
    DecodeError,
    HTTPError,
    NewConnectionError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.exceptions import TimeoutError as Urllib3TimeoutError
from urllib3.response import BaseHTTPResponse
from urllib3.util.ssl_match_hostname import CertificateError

from .deadline import Deadline
from .errors import (
    MediaDecodeError,
    MediaError,
    MediaFetchError,
    MediaRejectedError,
    MediaTimeoutError,
    MediaTooLargeError,
)
from .guard import PinnedTarget
from .policy import FetchPolicy

CHUNK = 64 * 1024
USER_AGENT = "rollout-queue-media-fetcher"


class _Watched:
    """Mixed into urllib3's connection classes: every new socket is watched by the deadline."""

    def __init__(self, *args: Any, deadline: Deadline, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    # _new_conn is the one place the TCP socket exists before the TLS handshake; watching it
    # from connect() instead would leave a dripped handshake outside the deadline.
    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()
        self._deadline.watch(sock)
        return sock


class _WatchedHTTPConnection(_Watched, HTTPConnection):
    pass


class _WatchedHTTPSConnection(_Watched, HTTPSConnection):
    pass


class _PinnedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _PinnedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


def open_pool(target: PinnedTarget, policy: FetchPolicy, deadline: Deadline) -> HTTPConnectionPool:
    """A one-connection pool whose sockets go to ``target.address`` only."""
    deadline.check()
    # urllib3 refuses a zero timeout with a ValueError: the budget may run out after the check.
    remaining = max(deadline.remaining(), 0.001)
    options: dict[str, Any] = {
        "host": target.address,
        "port": target.url.port,
        "maxsize": 1,
        "retries": False,  # retries are ours: only transient failures, only on GET
        "timeout": Timeout(connect=min(policy.connect_timeout, remaining), read=remaining),
        "deadline": deadline,  # handed on to the connection class
    }
    if target.url.scheme == "http":
        return _PinnedHTTPPool(**options)
    return _PinnedHTTPSPool(
        **options,
        cert_reqs="CERT_REQUIRED",
        ca_certs=str(policy.ca_certs) if policy.ca_certs else certifi.where(),
        server_hostname=target.url.host,
        assert_hostname=target.url.host,
    )


def send(
    pool: HTTPConnectionPool,
    target: PinnedTarget,
    method: str,
    headers: dict[str, str],
    body: bytes | None,
    deadline: Deadline,
) -> BaseHTTPResponse:
    """Send one request; the response's body is left unread. No redirect is followed."""
    deadline.check()
    request_headers = {"User-Agent": USER_AGENT, **headers, "Host": target.url.authority}
    try:
        return pool.urlopen(
            method,
            target.url.target,
            body=body,
            headers=request_headers,
            redirect=False,
            retries=False,
            assert_same_host=False,
            preload_content=False,
            decode_content=True,
        )
    except (HTTPError, OSError) as exc:
        raise translate(exc, deadline) from exc


def read_body(resp: BaseHTTPResponse, limit: int, deadline: Deadline, *, truncate: bool = False) -> bytes:
    """Read the decoded body, never holding more than ``limit`` bytes of it.

    The cap applies after content decoding: urllib3 (>= 2.6) inflates only as much of a gzip or
    deflate body as each read asks for, so a compression bomb stops at the cap. With
    ``truncate`` the first ``limit`` bytes are returned instead of failing.
    """
    declared = resp.headers.get("Content-Length")
    if not truncate and declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise MediaTooLargeError(f"the media is larger than {limit} bytes")
    buf = bytearray()
    try:
        for chunk in resp.stream(CHUNK, decode_content=True):
            buf += chunk
            if len(buf) > limit:
                if truncate:
                    del buf[limit:]
                    break
                raise MediaTooLargeError(f"the media is larger than {limit} bytes")
            deadline.check()
    except (HTTPError, OSError) as exc:
        raise translate(exc, deadline) from exc
    # A watchdog shutdown looks like an early end of a body without Content-Length.
    deadline.check()
    return bytes(buf)


def translate(exc: BaseException, deadline: Deadline) -> MediaError:
    """The media error for a urllib3/socket failure (typed, never from message text)."""
    if deadline.expired:
        return MediaTimeoutError("the media fetch ran past its total deadline")
    if isinstance(exc, DecodeError):
        return MediaDecodeError("the media's content encoding is corrupt")
    if isinstance(exc, NewConnectionError):  # subclasses ConnectTimeoutError, so it comes first
        return MediaFetchError("could not connect to the media host")
    if isinstance(exc, ConnectTimeoutError | ReadTimeoutError | Urllib3TimeoutError | socket.timeout):
        return MediaTimeoutError("the media host did not answer in time")
    # urllib3 checks the host name itself (CertificateError); OpenSSL checks the chain.
    if isinstance(exc, SSLError) and _caused_by(exc, (ssl.SSLCertVerificationError, CertificateError)):
        return MediaRejectedError("the media host's TLS certificate did not verify")
    return MediaFetchError("the connection to the media host failed")


def _caused_by(exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]) -> bool:
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, kind):
            return True
        stack.extend(arg for arg in cur.args if isinstance(arg, BaseException))
        stack.extend(e for e in (cur.__cause__, cur.__context__) if e is not None)
    return False
