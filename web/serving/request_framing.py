"""Where one HTTP/1.1 request ends, found before any thread sees it.

The API's event loop (``web/serving/request_buffering.py``) collects each request here until it is whole:
its head, then its body however it is framed (``Content-Length``, ``Transfer-Encoding: chunked``),
and no further, so the start of a pipelined second request stays behind for the next round. The
framing is h11's (a small, strict HTTP/1.1 state machine) rather than a parser of our own; the
bytes themselves are kept as they came, for gunicorn's parser to read in the thread, so what the
application sees is gunicorn's reading of the request, as before.

A body is kept in memory up to :data:`IN_MEMORY_BODY_BYTES` and on disk past it (an upload of
hundreds of MB costs a temporary file, not memory or a thread).
"""

from __future__ import annotations

import enum
import tempfile
from typing import IO

import h11

IN_MEMORY_BODY_BYTES = 1024 * 1024
# Past this without the end of the head, the request is refused (431), as gunicorn would.
MAX_HEAD_BYTES = 128 * 1024
# A body may take read_timeout plus one second per this many bytes: an upload of 200 MB on a slow
# link still arrives, and a sender that trickles is dropped (mod_reqtimeout's MinRate, in effect).
MIN_BODY_BYTES_PER_SECOND = 256 * 1024
# Chunk framing costs bytes beyond the body's own; past this many times the cap, it is refused.
_MAX_FRAMING_FACTOR = 4

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Progress(enum.Enum):
    NEED_MORE = "need_more"
    COMPLETE = "complete"  # head and body are in
    OVERSIZED = "oversized"  # the body is past the cap: the thread refuses it from what came (413)
    INVALID = "invalid"  # not HTTP/1.1 that h11 accepts: answered by the loop (error_status)


class IncomingRequest:
    """One request's bytes, fed as they arrive, until :meth:`feed` says it is whole.

    ``max_body_bytes`` is the largest body any route takes: a body past it stops here with what
    came (one byte past the route's own cap is all the view needs to refuse it), and a declared
    ``Content-Length`` past it stops at the head (werkzeug refuses it before reading).
    """

    def __init__(self, max_body_bytes: int, leftover: bytes = b""):
        self._framing = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._max_body_bytes = max_body_bytes
        self._head: bytes | None = None
        self._pending = bytearray()  # raw bytes before the head's end is known
        self._body: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=IN_MEMORY_BODY_BYTES)
        self._raw_body_bytes = 0
        self.body_bytes = 0  # the body's own bytes (chunk framing not counted)
        self.leftover = b""  # what came after this request: the start of a pipelined next one
        self.wants_continue = False  # Expect: 100-continue, not yet answered
        self.target = b""  # the request's path and query, once its head is in
        self.bearer = b""  # the key it presents (Authorization: Bearer), for sharing threads by key
        self.error_status = 400
        self.progress = Progress.NEED_MORE
        if leftover:
            self.feed(leftover)

    @property
    def received_any(self) -> bool:
        return self._head is not None or bool(self._pending)

    def feed(self, data: bytes) -> Progress:
        if self.progress is not Progress.NEED_MORE:
            raise RuntimeError("the request is already whole")
        self._framing.receive_data(data)
        if self._head is None:
            self._pending += data
        else:
            self._body.write(data)
            self._raw_body_bytes += len(data)
        try:
            self.progress = self._advance()
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint
            self.progress = Progress.INVALID
        if self.progress is Progress.COMPLETE:
            self._keep_only_this_request()
        return self.progress

    def _advance(self) -> Progress:
        while True:
            event = self._framing.next_event()
            if event is h11.NEED_DATA:
                return self._check_sizes()
            if isinstance(event, h11.Request):
                self._take_head(event)
                if _declared_length(event) > self._max_body_bytes:
                    self.wants_continue = False  # refused from the head: no body wanted
                    return Progress.OVERSIZED
            elif isinstance(event, h11.Data):
                self.body_bytes += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return Progress.COMPLETE

    def _take_head(self, request: h11.Request) -> None:
        unparsed = len(self._framing.trailing_data[0])
        head_length = len(self._pending) - unparsed
        head, body_start = bytes(self._pending[:head_length]), bytes(self._pending[head_length:])
        self._pending.clear()
        self.wants_continue = self._framing.they_are_waiting_for_100_continue
        self.target = request.target
        for name, value in request.headers:
            scheme, _, token = value.partition(b" ")
            if name == b"authorization" and scheme.lower() == b"bearer":
                self.bearer = token.strip()
        # The loop answers the expectation itself (or refuses the request): gunicorn must not
        # send a second 100 Continue once the body is already here.
        self._head = _without_header(head, b"expect") if self.wants_continue else head
        self._body.write(body_start)
        self._raw_body_bytes = len(body_start)

    def _check_sizes(self) -> Progress:
        if self._head is None:
            return Progress.NEED_MORE  # h11 itself refuses a head past MAX_HEAD_BYTES
        if (self.body_bytes > self._max_body_bytes
                or self._raw_body_bytes > _MAX_FRAMING_FACTOR * self._max_body_bytes + MAX_HEAD_BYTES):
            return Progress.OVERSIZED
        return Progress.NEED_MORE

    def _keep_only_this_request(self) -> None:
        unparsed = self._framing.trailing_data[0]
        if unparsed:
            self.leftover = bytes(unparsed)
            self._raw_body_bytes -= len(unparsed)
            self._body.truncate(self._raw_body_bytes)
            self._body.seek(self._raw_body_bytes)

    def source(self) -> RequestSource:
        """The request as gunicorn's parser reads it in the thread: its bytes, then end of input."""
        self._body.seek(0)
        return RequestSource(self._head or bytes(self._pending), self._body)

    def close(self) -> None:
        self._body.close()


class RequestSource:
    """Stands in for the socket under gunicorn's parser (it reads with ``recv`` only): the thread
    reads what the loop collected and never waits on the client. Past the request, end of input."""

    def __init__(self, head: bytes, body: IO[bytes]):
        self._head = memoryview(head)
        self._body = body

    def recv(self, size: int) -> bytes:
        if self._body.closed:
            return b""
        if self._head:
            piece, self._head = bytes(self._head[:size]), self._head[size:]
            return piece
        return self._body.read(size)

    def close(self) -> None:
        self._body.close()


def _declared_length(request: h11.Request) -> int:
    for name, value in request.headers:
        if name == b"content-length":
            return int(value)  # h11 has checked it is a number
    return 0


def _without_header(head: bytes, name: bytes) -> bytes:
    lines = head.split(b"\n")
    kept = [line for line in lines if line.split(b":", 1)[0].strip().lower() != name]
    return b"\n".join(kept)
