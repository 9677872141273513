"""A chunked request body, de-chunked as it arrives, in gunicorn's grammar.

The event loop (``web/serving/request_buffering.py``) must know where a chunked body ends without
blocking, and must read its chunk lines and trailers exactly as gunicorn would: h11, which did
this before, is lenient where gunicorn is strict (spaces after the size, an empty or NUL-bearing
extension, a last chunk ended by a bare LF, ``Content-Length`` or ``Authorization`` in the
trailers, a 20-digit size waited on), and the two read 29 framings differently. gunicorn's own
reader blocks on its source, so it cannot run in the loop; this walker takes bytes as they come
and hands each complete line to gunicorn's own checks (``ChunkedReader.parse_chunk_size``,
``ChunkedReader.parse_trailers``), so each line has one reading: gunicorn's. What is decoded is
handed on with a ``Content-Length`` (``web/serving/request_framing.py``), never as chunks.
"""

from __future__ import annotations

import enum
from typing import IO

from gunicorn.http.body import ChunkedReader
from gunicorn.http.errors import ChunkMissingTerminator, InvalidChunkSize, InvalidHeader, LimitRequestHeaders
from gunicorn.http.unreader import Unreader

# No body that large can exist: a size past it is refused at once rather than waited on.
MAX_CHUNK_SIZE = 2**63 - 1


class BytesUnreader(Unreader):
    """gunicorn's source over bytes already here: they, then end of input."""

    def __init__(self, data: bytes = b""):
        super().__init__()
        self._data = data

    def chunk(self, size_hint=None) -> bytes:
        data, self._data = self._data, b""
        return data


class _State(enum.Enum):
    SIZE = "size"  # a chunk's size line
    DATA = "data"  # its bytes
    DATA_END = "data_end"  # the CRLF after them
    TRAILERS = "trailers"  # after the last chunk: trailer fields, then an empty line
    DONE = "done"


class ChunkedBody:
    """Fed raw bytes after the head; writes the decoded body to ``sink``. ``feed`` returns what
    came past the body's end (a pipelined next request) once it is whole, or None while more is
    needed; it raises gunicorn's parse errors (answered as gunicorn answers them)."""

    def __init__(self, request, sink: IO[bytes]):
        self._reader = ChunkedReader(request, BytesUnreader())
        self._sink = sink
        self._line_limit = self._reader.limit_chunk_size_line
        self._trailer_limit = self._reader.limit_trailer_section
        self._buffer = bytearray()
        self._state = _State.SIZE
        self._remaining = 0
        self.size = 0  # decoded bytes so far

    @property
    def promised(self) -> int:
        """What the body will be at least: the bytes so far and the rest of the chunk under way."""
        return self.size + self._remaining

    def feed(self, data: bytes) -> bytes | None:
        self._buffer += data
        while self._state is not _State.DONE:
            if not self._step():
                return None
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest

    def _step(self) -> bool:
        """One move of the walk; False when it needs more bytes."""
        buffer = self._buffer
        if self._state is _State.DATA:
            if not buffer:
                return False
            taken = min(self._remaining, len(buffer))
            self._sink.write(buffer[:taken])
            del buffer[:taken]
            self._remaining -= taken
            self.size += taken
            if not self._remaining:
                self._state = _State.DATA_END
            return True
        if self._state is _State.DATA_END:
            if len(buffer) < 2:
                if buffer[:1] not in (b"", b"\r"):
                    raise ChunkMissingTerminator(bytes(buffer))
                return False
            if buffer[:2] != b"\r\n":
                raise ChunkMissingTerminator(bytes(buffer[:2]))
            del buffer[:2]
            self._state = _State.SIZE
            return True
        if self._state is _State.SIZE:
            return self._size_line()
        return self._trailers()

    def _size_line(self) -> bool:
        buffer = self._buffer
        end = buffer.find(b"\r\n")
        if end < 0:
            # gunicorn reads on until a CRLF, then refuses a line holding a bare LF: here at once.
            if b"\n" in buffer or len(buffer) > self._line_limit:
                raise InvalidChunkSize(bytes(buffer[:64]))
            return False
        line = bytes(buffer[:end])
        # The line alone, ended as if an empty trailer section followed: gunicorn's checks of the
        # size and its extensions, nothing read past it.
        size, _ = self._reader.parse_chunk_size(BytesUnreader(), data=line + b"\r\n\r\n")
        if size > MAX_CHUNK_SIZE:
            raise InvalidChunkSize(line[:64])
        del buffer[:end + 2]
        self._remaining = size
        self._state = _State.DATA if size else _State.TRAILERS
        return True

    def _trailers(self) -> bool:
        buffer = self._buffer
        end = 0 if buffer[:2] == b"\r\n" else buffer.find(b"\r\n\r\n")
        if end < 0:
            # As gunicorn's parse_trailers, but at once: a bare LF, or past the section's bound.
            if len(buffer) > self._trailer_limit:
                raise LimitRequestHeaders("limit request trailer section size")
            if buffer.count(b"\n") != buffer.count(b"\r\n"):
                raise InvalidHeader("bare LF as line terminator")
            return False
        section_end = 2 if end == 0 else end + 4
        # gunicorn's own reading of the section: forbidden fields (Content-Length, Authorization,
        # Host, ...), obs-fold and malformed lines raise; the fields themselves are not kept.
        self._reader.parse_trailers(BytesUnreader(), bytes(buffer[:section_end]))
        del buffer[:section_end]
        self._state = _State.DONE
        return True
