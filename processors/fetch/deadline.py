"""A total time budget for fetching, enforced even inside a blocking socket call.

One deadline may be shared by several fetches running at once (all media of one job): every
socket any of them opens is watched, and :meth:`Deadline.expire` ends them all early (one part
failed, so the others need not finish).

Socket timeouts only bound each single recv(): a server that sends one byte every few seconds
(slow drip, in the TLS handshake, the headers or the body) never trips them. The watchdog timer
shuts the watched sockets down when the budget runs out, which wakes any thread blocked on them;
the reader then sees ``expired`` and reports a timeout instead of a short body.
"""

from __future__ import annotations

import socket
import threading
import time

from .errors import MediaTimeoutError


class Deadline:
    def __init__(self, seconds: float):
        self._at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()

    @property
    def expired(self) -> bool:
        return self._expired or time.monotonic() >= self._at

    def remaining(self) -> float:
        return max(0.0, self._at - time.monotonic())

    def check(self) -> None:
        if self.expired:
            raise MediaTimeoutError("the media fetch ran past its total deadline")

    def expire(self) -> None:
        """End the budget now: every fetch sharing it stops at its next check or blocked read."""
        self._timer.cancel()
        self._expire()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self._expired:
                _shutdown(sock)
            else:
                self._sockets.append(sock)

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            for sock in self._sockets:
                _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        # The base class method on purpose: SSLSocket.shutdown() also drops its SSL object,
        # which a reader blocked in another thread may still be using.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: nothing left to wake
