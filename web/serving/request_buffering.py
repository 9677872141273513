"""Whole requests before threads: a slow client costs a socket, not a thread.

gunicorn's threaded worker hands a connection to a thread as soon as its first bytes arrive, and
the thread then blocks until the request it reads is complete: sockets sending partial headers,
a body that trickles (declared or chunked), a request that waits for ``100 Continue``, or the
start of a second request pipelined behind a first held a thread each for as long as they stayed
open, and a few hundred of them took every thread of the API for every key.

Here the worker's event loop collects each request itself, without blocking, until it is whole
(``web/serving/request_framing.py`` finds its end), answers ``Expect: 100-continue`` itself, and only
then hands the connection to a thread, whose parser reads those bytes and never the socket: a
thread never waits on a client. Each request has one deadline, ``ROLLOUT_REQUEST_READ_TIMEOUT``
plus a second per :data:`~web.serving.request_framing.MIN_BODY_BYTES_PER_SECOND` of body; a request not
whole by then is dropped in the loop (a JSON 408). Bytes of a pipelined next request wait in the
loop for the first to be answered. A whole request then waits in the loop for a thread of its
key's share (``web/serving/thread_share.py``): one key's calls that wait for their jobs never take every
thread, and ``/healthz``, ``/metrics`` and an admin's control calls have threads of their own. A
request gunicorn's grammar refuses is answered here (``web/serving/request_framing.py``), once, and
its connection closed; a thread reads each request re-framed with a ``Content-Length``.

Connections that send nothing cost a socket until ``ROLLOUT_REQUEST_FIRST_BYTE_TIMEOUT``, then are
closed; one peer holds at most ``ROLLOUT_API_CONNECTIONS_PER_PEER`` connections of a worker, more
are closed as they are accepted. Thousands of silent sockets reopened as they were dropped once
filled ``worker_connections``, and gthread stopped accepting: ``/healthz`` timed out.

The other way, a write that waits ``ROLLOUT_STREAM_WRITE_TIMEOUT`` (a reader that stopped
reading) fails and ends the connection.

Written on gthread's own hooks (``accept``, ``on_client_socket_readable``, ``finish_request``,
``murder_pending``): gunicorn has no setting for request read deadlines, and an async front
(nginx) is not part of ``rollout-queue up``.
"""

from __future__ import annotations

import errno
import selectors
import socket
import struct
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from gunicorn import util
from gunicorn.workers.gthread import TConn

from web.serving.early_errors import error_response
from web.serving.request_framing import (
    CONTINUE,
    MIN_BODY_BYTES_PER_SECOND,
    IncomingRequest,
    Progress,
    RequestSource,
)
from web.serving.thread_share import CONTROL_THREADS, OPS_THREADS, Lane, ThreadShare, lane, request_key


class RequestBuffering:
    """Mixed into a gthread worker class (``web/serving/server.py``): each request is collected in its
    event loop first. The server sets the class attributes from Settings."""

    read_timeout: float = 10.0
    first_byte_timeout: float = 5.0  # a connection silent this long is closed
    connections_per_peer: int = 512  # a peer's connections past this are closed as accepted
    write_timeout: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024  # the largest body any route takes
    per_key_threads: int | None = None  # None: a key may hold every thread (no keys configured)
    known_keys: frozenset[bytes] = frozenset()  # every configured key's digest (web/serving/thread_share.py)
    admin_keys: frozenset[bytes] = frozenset()  # the admin keys' digests; none and no keys: the open API

    def init_process(self):
        self._reading: dict[TConn, tuple[float, IncomingRequest]] = {}  # connection -> (start, request)
        threads = self.cfg.threads
        self._share = ThreadShare(threads, self.per_key_threads or threads)
        self._pools = {Lane.OPS: ThreadPoolExecutor(OPS_THREADS, thread_name_prefix="ops"),
                       Lane.CONTROL: ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="control")}
        self._peers: Counter = Counter()  # open connections per peer address
        super().init_process()  # runs the worker's loop until it stops

    # --- gthread's hooks: every request is collected here first -----------------------------------

    def accept(self, listener):
        try:
            client, address = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        peer = _peer(address)
        if self._peers[peer] >= self.connections_per_peer:
            util.close(client)  # never read: one peer does not fill the worker's connections
            return
        self.nr_conns += 1
        self._start_reading(_PeerConn(self.cfg, client, address, listener.getsockname(), self._peers, peer))

    def on_client_socket_readable(self, conn, client):
        """A kept-alive connection's next request: collected here too."""
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._start_reading(conn)

    def finish_request(self, conn, fs):
        """After a response: the start of a pipelined next request, already read, is collected here
        (gthread would hand it straight to a thread, to wait there for the rest)."""
        key = conn.__dict__.pop("share_key", None)
        if key is not None:
            self._share.done(key)
        leftover = conn.__dict__.pop("leftover", b"")
        source = getattr(getattr(conn.parser, "unreader", None), "sock", None)
        if isinstance(source, RequestSource):
            source.close()  # its body's memory or temporary file goes now, not at the next request
        keepalive = not fs.cancelled() and fs.exception() is None and fs.result() is True
        if leftover and keepalive and self.alive:
            self._start_reading(conn, leftover)
        else:
            super().finish_request(conn, fs)
        self._give_threads()

    def murder_pending(self):
        super().murder_pending()
        now = time.monotonic()
        for conn in [c for c, (start, request) in self._reading.items() if self._deadline(start, request) <= now]:
            request = self._reading[conn][1]
            self._drop(conn, error_response(408, timeout=self.read_timeout) if request.received_any else b"")

    def _deadline(self, start: float, request: IncomingRequest) -> float:
        if not request.received_any:
            return start + min(self.first_byte_timeout, self.read_timeout)
        return start + self.read_timeout + request.body_bytes / MIN_BODY_BYTES_PER_SECOND

    # --- collecting -----------------------------------------------------------------------------

    def _start_reading(self, conn: TConn, leftover: bytes = b"") -> None:
        conn.sock.setblocking(False)
        self._reading[conn] = (time.monotonic(), IncomingRequest(self.cfg, self.max_body_bytes, conn.client))
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._read_some, conn))
        if leftover:
            self._take(conn, leftover)

    def _read_some(self, conn: TConn, _client) -> None:
        try:
            data = conn.sock.recv(64 * 1024)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self._take(conn, data)
        else:
            self._drop(conn)

    def _take(self, conn: TConn, data: bytes) -> None:
        request = self._reading[conn][1]
        progress = request.feed(data)
        if progress is Progress.NEED_MORE:
            if request.wants_continue:  # the client waits for our word before it sends the body
                request.wants_continue = False
                self._write(conn, CONTINUE)
        elif progress is Progress.INVALID:  # gunicorn's refusal, answered as gunicorn answers it
            self._forget(conn)
            self.handle_error(None, conn.sock, conn.client, request.error)
            self._close(conn)
        else:  # whole, or past the cap: the thread answers it (a 413 from what came, if past)
            self._hand_over(conn, request)

    def _hand_over(self, conn: TConn, request: IncomingRequest) -> None:
        self.poller.unregister(conn.sock)
        del self._reading[conn]
        conn.leftover = request.leftover
        conn.sock.setblocking(True)
        # A send that waits this long (a reader that stopped reading: an SSE stream, a large result)
        # fails, and the connection ends: set on the socket itself, as gunicorn writes with blocking
        # sendall and keeps no timeout of its own (setblocking does not clear SO_SNDTIMEO).
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.write_timeout))
        conn.init()  # the parser (plain HTTP/1.1: no TLS or h2 preface here, so nothing is read)
        conn.parser.unreader.sock = request.source()
        conn.data_ready = True
        key = request_key(request.authorization, self.known_keys)
        admin = (key in self.admin_keys) if self.known_keys else True  # no keys: anyone may steer
        where = lane(request.path, admin)
        if where is Lane.SHARE:
            self._share.add(key, conn)
            self._give_threads()
        else:
            done = self._pools[where].submit(self.handle, conn)
            done.add_done_callback(lambda fut: self.method_queue.defer(self.finish_request, conn, fut))

    def _give_threads(self) -> None:
        """Free threads to the requests waiting for them, each key within its share."""
        while (taken := self._share.take()) is not None:
            key, conn = taken
            conn.share_key = key
            self.enqueue_req(conn)

    def _drop(self, conn: TConn, answer: bytes = b"") -> None:
        self._forget(conn)
        if answer:
            self._write(conn, answer)
        self._close(conn)

    def _forget(self, conn: TConn) -> None:
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        _, request = self._reading.pop(conn, (0.0, None))
        if request is not None:
            request.close()

    def _close(self, conn: TConn) -> None:
        self.nr_conns -= 1
        conn.close()

    @staticmethod
    def _write(conn: TConn, data: bytes) -> None:
        try:
            util.write_nonblock(conn.sock, data)
        except Exception:  # the client is gone or not reading: nothing more to tell it
            pass


class _PeerConn(TConn):
    """A connection counted against its peer's connections until it closes (every way gthread and
    the loop end a connection goes through ``close``; all of them run on the loop's thread)."""

    def __init__(self, cfg, sock, client, server, peers: Counter, peer: str):
        super().__init__(cfg, sock, client, server)
        self._peers, self._peer = peers, peer
        peers[peer] += 1

    def close(self, graceful=False):
        if self._peers is not None:
            self._peers[self._peer] -= 1
            if self._peers[self._peer] <= 0:
                del self._peers[self._peer]
            self._peers = None
        super().close(graceful)


def _peer(address) -> str:
    """The peer's address without its port (a Unix socket's peers are one)."""
    return str(address[0]) if isinstance(address, tuple) and address else "unix"


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
