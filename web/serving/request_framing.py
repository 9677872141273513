"""Where one HTTP/1.1 request ends, whether it is one, and what a thread then reads of it.

The API's event loop (``web/serving/request_buffering.py``) collects each request here until it is
whole: its head, then its body however it is framed (``Content-Length``, ``Transfer-Encoding:
chunked``), and no further, so the start of a pipelined second request stays behind for the next
round.

One grammar, gunicorn's. The loop once framed requests with h11 and handed the client's bytes on
for gunicorn to parse again in the thread; the two disagreed on 29 framings (h11 took them whole,
gunicorn refused them half-way through the body: a 500 with a traceback, or an answer from the
route and then a stray 400 that a pipelining client reads as its next answer). Now:

- the head is parsed here by gunicorn's own parser (``gunicorn.http.message.Request``) with the
  worker's settings, and a head it refuses is answered here, before any thread;
- a chunked body is walked here with gunicorn's own chunk-line and trailer checks
  (``web/serving/chunked_body.py``), and a bad chunk is answered here too;
- the thread's parser is handed the request re-framed: the head as it came without its framing
  (``Content-Length``, ``Transfer-Encoding``, ``Expect``), a ``Content-Length`` of the body as
  decoded, then that body. gunicorn never reads the client's framing, so there is nothing left for
  the two to read differently.

A body is kept in memory up to :data:`IN_MEMORY_BODY_BYTES` and on disk past it (an upload of
hundreds of MB costs a temporary file, not memory or a thread).
"""

from __future__ import annotations

import enum
import tempfile
from typing import IO

from gunicorn import util
from gunicorn.http.body import ChunkedReader, LengthReader
from gunicorn.http.errors import (
    InvalidHeader,
    InvalidRequestLine,
    LimitRequestHeaders,
    NoMoreData,
    ParseException,
    UnsupportedTransferCoding,
)
from gunicorn.http.message import Request

from web.serving.chunked_body import BytesUnreader, ChunkedBody

IN_MEMORY_BODY_BYTES = 1024 * 1024
# Past this without the end of the head, the request is refused (431).
MAX_HEAD_BYTES = 128 * 1024
# A body may take read_timeout plus one second per this many bytes: an upload of 200 MB on a slow
# link still arrives, and a sender that trickles is dropped (mod_reqtimeout's MinRate, in effect).
MIN_BODY_BYTES_PER_SECOND = 256 * 1024
# Chunk framing costs bytes beyond the body's own; past this many times the cap, it is refused.
_MAX_FRAMING_FACTOR = 4
# Fields the loop has acted on, left out of the head handed on: it re-frames the body, and it has
# answered the expectation (gunicorn must not send a second 100 Continue).
_REFRAMED = frozenset({b"content-length", b"transfer-encoding", b"expect"})
# Transfer codings a request may carry: the body is de-chunked here, and nothing decodes the rest.
_CODINGS = frozenset({"chunked", "identity"})

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Progress(enum.Enum):
    NEED_MORE = "need_more"
    COMPLETE = "complete"  # head and body are in
    OVERSIZED = "oversized"  # the body is past the cap: the thread refuses it from its head (413)
    INVALID = "invalid"  # refused by gunicorn's grammar: ``error`` says how, answered by the loop


class IncomingRequest:
    """One request's bytes, fed as they arrive, until :meth:`feed` says it is whole.

    ``cfg`` is the worker's gunicorn configuration (its limits apply here as in the thread).
    ``max_body_bytes`` is the largest body any route takes: a body past it stops here with what
    came, and a declared ``Content-Length`` past it stops at the head; either way the head handed
    on declares a length past the cap, so the app refuses it (413) before reading.
    """

    def __init__(self, cfg, max_body_bytes: int, peer=("", -1), leftover: bytes = b""):
        self._cfg = cfg
        self._peer = peer
        self._max_body_bytes = max_body_bytes
        self._pending = bytearray()  # the head, until its end is in
        self._line_checked = False
        self._head: bytes | None = None
        self._length: int | None = None  # a declared Content-Length
        self._chunks: ChunkedBody | None = None
        self._body: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=IN_MEMORY_BODY_BYTES)
        self._raw_body_bytes = 0
        self.body_bytes = 0  # the body's own bytes (chunk framing not counted)
        self.leftover = b""  # what came after this request: the start of a pipelined next one
        self.wants_continue = False  # Expect: 100-continue, not yet answered
        self.path = ""  # the path the app routes (gunicorn's PATH_INFO), once the head is in
        self.authorization: str | None = None  # its Authorization as the app reads it
        self.error: ParseException | None = None
        self.progress = Progress.NEED_MORE
        if leftover:
            self.feed(leftover)

    @property
    def received_any(self) -> bool:
        return self._head is not None or bool(self._pending)

    def feed(self, data: bytes) -> Progress:
        if self.progress is not Progress.NEED_MORE:
            raise RuntimeError("the request is already whole")
        try:
            self.progress = self._take(data)
        except ParseException as e:
            self.error = e
            self.progress = Progress.INVALID
        return self.progress

    def _take(self, data: bytes) -> Progress:
        if self._head is None:
            body_start = self._take_head(data)
            if body_start is None:
                return Progress.NEED_MORE
            if (self._length or 0) > self._max_body_bytes:
                self.wants_continue = False  # refused from the head: no body wanted
                return Progress.OVERSIZED
            if self._chunks is None and not self._length:
                self.leftover = body_start
                return Progress.COMPLETE
            data = body_start
        progress = self._take_body(data)
        if progress is not Progress.NEED_MORE:
            self.wants_continue = False
        return progress

    # --- the head ---------------------------------------------------------------------------------

    def _take_head(self, data: bytes) -> bytes | None:
        """The bytes after the head once it is in and taken, else None."""
        pending = self._pending
        start = len(pending)
        pending += data
        end = pending.find(b"\r\n\r\n", max(0, start - 3))
        if end < 0:
            if _has_bare_lf(pending, start):
                self._refuse_partial(InvalidHeader("bare LF as line terminator"))
            if len(pending) > MAX_HEAD_BYTES:
                self._refuse_partial(LimitRequestHeaders("max buffer headers"))
            if not self._line_checked and len(pending) > self._cfg.limit_request_line + 2:
                self._line_checked = True  # a request line past its limit is refused now
                self._parse(bytes(pending))
            return None
        head, rest = bytes(pending[:end + 4]), bytes(pending[end + 4:])
        self._pending = bytearray()
        request = self._parse(head)
        if request is None:  # not expected past an empty line; refused rather than waited on
            raise InvalidRequestLine(head[:64].decode("latin-1"))
        self._take_fields(request)
        self._head = head
        return rest

    def _refuse_partial(self, otherwise: ParseException) -> None:
        """gunicorn's refusal of the head so far, or ``otherwise`` where it would read on."""
        self._parse(bytes(self._pending))
        raise otherwise

    def _parse(self, head: bytes) -> Request | None:
        """gunicorn's parse of ``head`` (it raises what it refuses); None while it wants more."""
        try:
            return Request(self._cfg, BytesUnreader(head), self._peer)
        except (NoMoreData, StopIteration):
            return None

    def _take_fields(self, request: Request) -> None:
        names = [name for name, _ in request.headers]
        if request.version >= (1, 1) and "HOST" not in names:
            raise InvalidHeader("HOST")  # RFC 9112 section 3.2: a 1.1 request without Host is a 400
        reader = request.body.reader
        if isinstance(reader, ChunkedReader):
            for name, value in request.headers:
                if name == "TRANSFER-ENCODING" and any(
                        coding.strip(" \t").lower() not in _CODINGS for coding in value.split(",")):
                    raise UnsupportedTransferCoding(value)
            self._chunks = ChunkedBody(request, self._body)
        elif isinstance(reader, LengthReader):
            self._length = reader.length
        self.path = util.unquote_to_wsgi_str(request.path)
        authorizations = [value for name, value in request.headers if name == "AUTHORIZATION"]
        self.authorization = ",".join(authorizations) if authorizations else None  # as gunicorn joins them
        self.wants_continue = request._expected_100_continue

    # --- the body ---------------------------------------------------------------------------------

    def _take_body(self, data: bytes) -> Progress:
        if self._chunks is not None:
            rest = self._chunks.feed(data)
            self._raw_body_bytes += len(data) - len(rest or b"")
            self.body_bytes = self._chunks.size
            if (self._chunks.promised > self._max_body_bytes
                    or self._raw_body_bytes > _MAX_FRAMING_FACTOR * self._max_body_bytes + MAX_HEAD_BYTES):
                return Progress.OVERSIZED
            if rest is None:
                return Progress.NEED_MORE
            self.leftover = rest
            return Progress.COMPLETE
        wanted = self._length - self.body_bytes
        self._body.write(data[:wanted])
        self.body_bytes += min(wanted, len(data))
        if self.body_bytes < self._length:
            return Progress.NEED_MORE
        self.leftover = data[wanted:]
        return Progress.COMPLETE

    # --- what the thread reads --------------------------------------------------------------------

    def source(self) -> RequestSource:
        """The request as gunicorn's parser reads it in the thread, re-framed: its bytes, then end
        of input."""
        self._body.seek(0)
        return RequestSource(self._reframed_head(), self._body)

    def _reframed_head(self) -> bytes:
        lines = self._head.split(b"\r\n")[:-2]  # it ends with the empty line
        if lines[0] == b"":
            lines = lines[1:]  # the one empty line allowed before the request line
        kept = [lines[0]] + [line for line in lines[1:] if line.split(b":", 1)[0].lower() not in _REFRAMED]
        if self._chunks is not None or self._length is not None:
            length = self.body_bytes
            if self.progress is Progress.OVERSIZED:
                length = max(self._length or 0, self._chunks.promised if self._chunks else 0, self._max_body_bytes + 1)
            kept.append(b"Content-Length: %d" % length)
        return b"\r\n".join(kept) + b"\r\n\r\n"

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


def _has_bare_lf(data: bytearray, start: int) -> bool:
    """Whether an LF not after a CR came at or past ``start`` (gunicorn refuses any in a head)."""
    at = data.find(b"\n", start)
    while at >= 0:
        if at == 0 or data[at - 1] != 0x0D:
            return True
        at = data.find(b"\n", at + 1)
    return False
