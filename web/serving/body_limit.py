"""Request bodies past their limit are a 413, whether or not they declare their length.

werkzeug checks ``Content-Length`` against ``max_content_length`` before reading. A chunked body
has none: werkzeug then reads up to ``max_content_length`` bytes and stops there without an error
(``LimitedStream.readall``), so a longer body came to the views silently cut. Here such a body
is read up to one byte past the limit, and that byte, if it comes, makes the read a 413.
"""

from __future__ import annotations

from typing import IO

import flask
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.utils import cached_property
from werkzeug.wsgi import LimitedStream


class _BoundedStream(LimitedStream):
    def __init__(self, stream: IO[bytes], limit: int):
        super().__init__(stream, limit + 1, is_max=True)
        self.max_bytes = limit

    def readinto(self, b) -> int | None:
        count = super().readinto(b)
        if self.tell() > self.max_bytes:
            raise RequestEntityTooLarge(f"the request body is larger than {self.max_bytes} bytes")
        return count


class BoundedRequest(flask.Request):
    @cached_property
    def stream(self) -> IO[bytes]:
        limit = self.max_content_length
        chunked = self.content_length is None and "wsgi.input_terminated" in self.environ
        if chunked and limit is not None and not self.shallow:
            return _BoundedStream(self.environ["wsgi.input"], limit)
        return super().stream
