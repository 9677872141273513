"""A catalogue of HTTP/1.1 request framings, each with the answer the API must give it
(``tests/web/serving/test_one_grammar.py`` sends them over real sockets).

Refused framings name the early status (gunicorn's grammar: 400, 414, 417, 431 or 501); taken ones
are ``None``: the route's own answer. Each request ends with a pipelined ``GET /healthz``, so a
framing read two ways shows as a second response.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.web.conftest import KEY_A

BODY = b'{"prompt": "hi", "sampling_params": {"max_tokens": 2}}'
JOB = "POST /v1/jobs HTTP/1.1"


@dataclass(frozen=True)
class Framing:
    name: str
    head: bytes  # request line and headers, CRLF-ended, without the blank line or the key
    rest: bytes  # from the blank line on: the head's end, then the body as framed
    status: int | None  # None: taken, answered by the route

    def request(self, keyed: bool) -> bytes:
        key = f"Authorization: Bearer {KEY_A}\r\n".encode() if keyed else b""
        return self.head + key + self.rest


def _head(line: str = JOB, *headers: str) -> bytes:
    return "\r\n".join((line, "Host: x", "Content-Type: application/json", *headers)).encode("latin-1") + b"\r\n"


def _chunked(*headers: str) -> bytes:
    return _head(JOB, "Transfer-Encoding: chunked", *headers)


def _sized(*headers: str) -> bytes:
    return _head(JOB, f"Content-Length: {len(BODY)}", *headers)


def _chunks(*lines: bytes, last: bytes = b"0\r\n\r\n") -> bytes:
    """The blank line after the head, then the body in one chunk whose size line is each of lines."""
    return b"\r\n" + b"".join(line + b"\r\n" + BODY + b"\r\n" for line in lines) + last


SIZE = b"%x" % len(BODY)
SIZED = b"\r\n" + BODY

TAKEN = [
    Framing("content-length", _sized(), SIZED, None),
    Framing("chunked", _chunked(), _chunks(SIZE), None),
    Framing("chunked in two chunks", _chunked(), b"\r\n5\r\n" + BODY[:5] + b"\r\n" + b"%x" % (len(BODY) - 5)
            + b"\r\n" + BODY[5:] + b"\r\n0\r\n\r\n", None),
    Framing("chunk size in upper case, leading zeros", _chunked(), _chunks(b"00" + SIZE.upper()), None),
    Framing("chunk extension token", _chunked(), _chunks(SIZE + b";a=b"), None),
    Framing("chunk extension quoted", _chunked(), _chunks(SIZE + b';a="b c"'), None),
    Framing("chunk extension with spaces before ;", _chunked(), _chunks(SIZE + b" ;a"), None),
    Framing("trailer field", _chunked(), _chunks(SIZE, last=b"0\r\nX-Checksum: 1\r\n\r\n"), None),
    Framing("Transfer-Encoding Chunked", _head(JOB, "Transfer-Encoding: Chunked"), _chunks(SIZE), None),
    Framing("content-length with leading zeros", _head(JOB, f"Content-Length: 00{len(BODY)}"), SIZED, None),
    Framing("one empty line before the request line", b"\r\n" + _sized(), SIZED, None),
    Framing("absolute-form target", _head("POST http://x/v1/jobs HTTP/1.1", f"Content-Length: {len(BODY)}"),
            SIZED, None),
    # A later minor version is read as 1.1 (RFC 9112 section 2.3), as gunicorn does.
    Framing("HTTP/1.2", _head("POST /v1/jobs HTTP/1.2", f"Content-Length: {len(BODY)}"), SIZED, None),
    Framing("HTTP/1.0 with a length", _head("POST /v1/jobs HTTP/1.0", f"Content-Length: {len(BODY)}"), SIZED, None),
    Framing("expect 100-continue, body at once", _sized("Expect: 100-continue"), SIZED, None),
    Framing("header with an underscore (dropped)", _sized("X_Forwarded_For: 1.2.3.4"), SIZED, None),
    Framing("header value with obs-text", _sized("X-Note: caf\xe9"), SIZED, None),
    Framing("header value with inner tab", _sized("X-Note: a\tb"), SIZED, None),
]

REFUSED = [
    # chunk size lines
    Framing("chunk size, trailing space", _chunked(), _chunks(SIZE + b" "), 400),
    Framing("chunk size, trailing tab", _chunked(), _chunks(SIZE + b"\t"), 400),
    Framing("chunk size, leading space", _chunked(), _chunks(b" " + SIZE), 400),
    Framing("chunk size 0x", _chunked(), _chunks(b"0x" + SIZE), 400),
    Framing("chunk size signed", _chunked(), _chunks(b"+" + SIZE), 400),
    Framing("chunk size empty", _chunked(), _chunks(b""), 400),
    Framing("chunk size of 20 hex digits", _chunked(), b"\r\nFFFFFFFFFFFFFFFFFFFF\r\nab", 400),
    Framing("chunk extension empty", _chunked(), _chunks(SIZE + b";"), 400),
    Framing("chunk extension with NUL", _chunked(), _chunks(SIZE + b";a\x00"), 400),
    Framing("chunk extension with CR", _chunked(), _chunks(SIZE + b";a\rb"), 400),
    Framing("chunk extension with a space in it", _chunked(), _chunks(SIZE + b";a b"), 400),
    Framing("chunk extension without a name", _chunked(), _chunks(SIZE + b";=b"), 400),
    Framing("chunk extension, quote unclosed", _chunked(), _chunks(SIZE + b';a="b'), 400),
    Framing("chunk size line ends in LF", _chunked(), b"\r\n" + SIZE + b"\n" + BODY + b"\r\n0\r\n\r\n", 400),
    Framing("chunk data longer than its size", _chunked(), b"\r\n5\r\n" + BODY + b"\r\n0\r\n\r\n", 400),
    Framing("chunk data ends in LF", _chunked(), b"\r\n" + SIZE + b"\r\n" + BODY + b"\n0\r\n\r\n", 400),
    # the last chunk and trailers
    Framing("last chunk 0 CRLF LF", _chunked(), _chunks(SIZE, last=b"0\r\n\n"), 400),
    Framing("last chunk 0 LF CRLF", _chunked(), _chunks(SIZE, last=b"0\n\r\n"), 400),
    Framing("trailer Content-Length", _chunked(), _chunks(SIZE, last=b"0\r\nContent-Length: 5\r\n\r\n"), 400),
    Framing("trailer Authorization", _chunked(), _chunks(SIZE, last=b"0\r\nAuthorization: Bearer k\r\n\r\n"), 400),
    Framing("trailer Transfer-Encoding", _chunked(), _chunks(SIZE, last=b"0\r\nTransfer-Encoding: x\r\n\r\n"), 400),
    Framing("trailer Host", _chunked(), _chunks(SIZE, last=b"0\r\nHost: y\r\n\r\n"), 400),
    Framing("trailer ends in bare LF", _chunked(), _chunks(SIZE, last=b"0\r\nX-T: 1\n\r\n"), 400),
    Framing("trailer obs-fold", _chunked(), _chunks(SIZE, last=b"0\r\nX-T: 1\r\n 2\r\n\r\n"), 400),
    Framing("trailer name with a space", _chunked(), _chunks(SIZE, last=b"0\r\nX T: 1\r\n\r\n"), 400),
    # body framing headers
    Framing("Content-Length and Transfer-Encoding", _chunked(f"Content-Length: {len(BODY)}"), _chunks(SIZE), 400),
    Framing("Transfer-Encoding and Content-Length", _head(JOB, f"Content-Length: {len(BODY)}",
                                                          "Transfer-Encoding: chunked"), _chunks(SIZE), 400),
    Framing("Content-Length twice, same value", _sized(f"Content-Length: {len(BODY)}"), SIZED, 400),
    Framing("Content-Length twice, different", _sized("Content-Length: 3"), SIZED, 400),
    Framing("Content-Length list", _head(JOB, f"Content-Length: {len(BODY)}, {len(BODY)}"), SIZED, 400),
    Framing("Content-Length signed", _head(JOB, f"Content-Length: +{len(BODY)}"), SIZED, 400),
    Framing("Content-Length negative", _head(JOB, "Content-Length: -1"), SIZED, 400),
    Framing("Content-Length in hex", _head(JOB, "Content-Length: 0x10"), SIZED, 400),
    Framing("Content-Length superscript digit", _head(JOB, "Content-Length: \xb2"), SIZED, 400),
    Framing("Transfer-Encoding chunked twice", _chunked("Transfer-Encoding: chunked"), _chunks(SIZE), 400),
    Framing("Transfer-Encoding chunked, gzip", _head(JOB, "Transfer-Encoding: chunked, gzip"), _chunks(SIZE), 400),
    Framing("Transfer-Encoding unknown", _head(JOB, "Transfer-Encoding: xchunked"), _chunks(SIZE), 501),
    Framing("Transfer-Encoding gzip, chunked", _head(JOB, "Transfer-Encoding: gzip, chunked"), _chunks(SIZE), 501),
    Framing("Transfer-Encoding in HTTP/1.0", _head("POST /v1/jobs HTTP/1.0", "Transfer-Encoding: chunked"),
            _chunks(SIZE), 400),
    # heads
    Framing("request line ends in LF", _sized().replace(b"HTTP/1.1\r\n", b"HTTP/1.1\n"), SIZED, 400),
    Framing("a header ends in LF", _sized().replace(b"Host: x\r\n", b"Host: x\n"), SIZED, 400),
    Framing("head of bare LFs", _sized().replace(b"\r\n", b"\n"), b"\n" + BODY, 400),
    Framing("obs-fold header", _sized("X-Note: a", " b"), SIZED, 400),
    Framing("space before the colon", _sized("X-Note : a"), SIZED, 400),
    Framing("header name with (", _sized("X(: a"), SIZED, 400),
    Framing("header without a name", _sized(": a"), SIZED, 400),
    Framing("header value with CR", _sized("X-Note: a\rb"), SIZED, 400),
    Framing("header value with DEL", _sized("X-Note: a\x7fb"), SIZED, 400),
    Framing("header value with NUL", _sized("X-Note: a\x00b"), SIZED, 400),
    Framing("Host twice", _sized("Host: y"), SIZED, 400),
    Framing("no Host in HTTP/1.1", _sized().replace(b"Host: x\r\n", b""), SIZED, 400),
    Framing("HTTP/2.0", _head("POST /v1/jobs HTTP/2.0", f"Content-Length: {len(BODY)}"), SIZED, 400),
    Framing("HTTP/11", _head("POST /v1/jobs HTTP/11", f"Content-Length: {len(BODY)}"), SIZED, 400),
    Framing("lower-case method", _head("post /v1/jobs HTTP/1.1", f"Content-Length: {len(BODY)}"), SIZED, 400),
    Framing("two-letter method", _head("PO /v1/jobs HTTP/1.1", f"Content-Length: {len(BODY)}"), SIZED, 400),
    Framing("method with #", _head("PO#T /v1/jobs HTTP/1.1", f"Content-Length: {len(BODY)}"), SIZED, 400),
    Framing("two spaces in the request line", _head("POST  /v1/jobs HTTP/1.1", f"Content-Length: {len(BODY)}"),
            SIZED, 400),
    Framing("space after the version", _head("POST /v1/jobs HTTP/1.1 ", f"Content-Length: {len(BODY)}"), SIZED, 400),
    Framing("target with obs-text", _head("POST /v1/jobs\xff HTTP/1.1", f"Content-Length: {len(BODY)}"), SIZED, 400),
    Framing("target with a control", _head("POST /v1/\x01jobs HTTP/1.1", f"Content-Length: {len(BODY)}"), SIZED, 400),
    Framing("two empty lines before the request line", b"\r\n\r\n" + _sized(), SIZED, 400),
    Framing("Expect other than 100-continue", _sized("Expect: 200-ok"), SIZED, 417),
    Framing("request line too long", _head(f"POST /v1/jobs?{'a' * 5000} HTTP/1.1", f"Content-Length: {len(BODY)}"),
            SIZED, 414),
    Framing("header too long", _sized(f"X-Long: {'y' * 9000}"), SIZED, 431),
    Framing("too many headers", _sized(*(f"X-{n}: y" for n in range(120))), SIZED, 431),
]

CATALOGUE = TAKEN + REFUSED
