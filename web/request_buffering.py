"""Whole requests before threads: a slow client costs a socket, not a thread.

gunicorn's threaded worker hands a connection to a thread as soon as its first bytes arrive, and
the thread then blocks until the request head (and the body the view reads) is complete: ten
sockets sending partial headers, or a declared body that trickles, held threads for as long as
they stayed open, and ~550 of them took every thread of the API for every key. Here the worker's
event loop reads each request itself, without blocking, until its head and a body of up to
:data:`BUFFERED_BODY_BYTES` are in, and only then hands the connection to a thread with those
bytes already in its parser. A request not complete within ``ROLLOUT_REQUEST_READ_TIMEOUT`` is
dropped in the loop (a JSON 408). A larger body (a batch upload) or ``Expect: 100-continue`` goes
to a thread after its head, and each read of the rest must come within the same timeout, or the
body ends there (the view sees a client that went away). The other way, a write that waits
``ROLLOUT_STREAM_WRITE_TIMEOUT`` (a reader that stopped reading) fails and ends the connection.

Written on gthread's own hooks (``accept``, ``on_client_socket_readable``, ``murder_pending``):
gunicorn has no setting for header or body read timeouts, and an async front (nginx) is not part
of ``rollout-queue up``.
"""

from __future__ import annotations

import errno
import json
import selectors
import socket
import struct
import time
from functools import partial

from gunicorn import util
from gunicorn.workers.gthread import TConn

BUFFERED_BODY_BYTES = 1024 * 1024
# Past this without the end of the head, the thread's parser sees it and refuses it itself (431).
_MAX_HEAD_BYTES = 128 * 1024
_HEAD_END = b"\r\n\r\n"


class RequestBuffering:
    """Mixed into a gthread worker class (``web/server.py``): each request head (and a small body)
    is read in its event loop first. ``read_timeout`` is set on the class the server builds."""

    read_timeout: float = 10.0
    write_timeout: float = 30.0

    def init_process(self):
        self._reading: dict[TConn, float] = {}  # connection -> deadline for its request to be in
        super().init_process()

    # --- gthread's hooks: every request is read here first ----------------------------------------

    def accept(self, listener):
        try:
            client, address = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        self._start_reading(TConn(self.cfg, client, address, listener.getsockname()))

    def on_client_socket_readable(self, conn, client):
        """A kept-alive connection's next request: read it here too."""
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._start_reading(conn)

    def murder_pending(self):
        super().murder_pending()
        now = time.monotonic()
        for conn in [c for c, deadline in self._reading.items() if deadline <= now]:
            self._drop(conn, timed_out=True)

    # --- reading ------------------------------------------------------------------------------------

    def _start_reading(self, conn: TConn) -> None:
        conn.sock.setblocking(False)
        conn.request_bytes = bytearray()
        self._reading[conn] = time.monotonic() + self.read_timeout
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._read_some, conn))

    def _read_some(self, conn: TConn, _client) -> None:
        try:
            data = conn.sock.recv(64 * 1024)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.request_bytes += data
        if _ready(conn.request_bytes):
            self._hand_over(conn)

    def _hand_over(self, conn: TConn) -> None:
        self.poller.unregister(conn.sock)
        del self._reading[conn]
        buffered = bytes(conn.request_bytes)
        del conn.request_bytes
        conn.sock.setblocking(True)
        # A send that waits this long (a reader that stopped reading: an SSE stream, a large result)
        # fails, and the connection ends: set on the socket itself, as gunicorn writes with blocking
        # sendall and keeps no timeout of its own (setblocking does not clear SO_SNDTIMEO).
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.write_timeout))
        conn.init()  # the parser (plain HTTP/1.1: no TLS or h2 preface here, so nothing is read)
        unreader = conn.parser.unreader
        if not isinstance(unreader.sock, _IdleLimited):
            unreader.sock = _IdleLimited(conn.sock, self.read_timeout)
        unreader.unread(buffered)
        conn.data_ready = True
        self.enqueue_req(conn)

    def _drop(self, conn: TConn, *, timed_out: bool = False) -> None:
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self._reading.pop(conn, None)
        if timed_out and conn.request_bytes:
            body = json.dumps({"code": "request_timeout", "message": f"the request did not arrive within "
                               f"{self.read_timeout:g} s"}).encode()
            head = (f"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            try:
                util.write_nonblock(conn.sock, head + body)
            except Exception:  # the client is gone or not reading: nothing more to tell it
                pass
        self.nr_conns -= 1
        conn.close()


def _ready(data: bytearray) -> bool:
    """Whether a thread may take the request now: its head and (up to the buffered size) its body
    are in, or it is too large to wait for here."""
    end = data.find(_HEAD_END)
    if end < 0:
        return len(data) > _MAX_HEAD_BYTES
    headers = {}
    for line in bytes(data[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    if b"100-continue" in headers.get(b"expect", b"") or b"transfer-encoding" in headers:
        return True  # the client waits for us (Expect), or the body's end is the parser's to find
    try:
        length = int(headers.get(b"content-length", b"0"))
    except ValueError:
        return True  # the parser refuses it
    return length > BUFFERED_BODY_BYTES or len(data) - end - len(_HEAD_END) >= length


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))


class _IdleLimited:
    """The socket as the parser reads a large body in its thread: a read that waits longer than
    ``timeout`` ends the body there (EOF), so a trickling sender holds a thread at most that long
    per read."""

    def __init__(self, sock: socket.socket, timeout: float):
        self._sock = sock
        self._timeout = timeout

    def recv(self, size: int) -> bytes:
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            if not selector.select(self._timeout):
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # and no keep-alive after this request
                except OSError:
                    pass
                return b""
        return self._sock.recv(size)

    def __getattr__(self, name):
        return getattr(self._sock, name)
