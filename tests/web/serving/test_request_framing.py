"""Where a request ends, as the API's event loop finds it before a thread takes it
(web/serving/request_framing.py): whole requests of each framing, fed a byte at a time or all at once,
come out as gunicorn's parser then reads them (re-framed with a Content-Length), and nothing past
their end; what gunicorn's grammar refuses is refused here, with gunicorn's error."""

from __future__ import annotations

import pytest
from gunicorn.config import Config
from gunicorn.http import errors
from gunicorn.http.parser import RequestParser

from web.serving.request_framing import IN_MEMORY_BODY_BYTES, IncomingRequest, Progress

GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
POST = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
CHUNKED = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n"


def fed(data: bytes, *, step: int | None = None, max_body: int = 1 << 20) -> IncomingRequest:
    request = IncomingRequest(Config(), max_body)
    pieces = [data] if step is None else [data[i:i + step] for i in range(0, len(data), step)]
    for piece in pieces:
        if request.feed(piece) is not Progress.NEED_MORE:
            break
    return request


def as_gunicorn_reads(request: IncomingRequest) -> tuple[str, bytes]:
    parser = RequestParser(Config(), request.source(), ("127.0.0.1", 1))
    message = next(parser)
    return message.method, message.body.read()


@pytest.mark.parametrize("data, method, body", [(GET, "GET", b""), (POST, "POST", b"hello"),
                                                (CHUNKED, "POST", b"hello")])
@pytest.mark.parametrize("step", [None, 1, 7])
def test_a_whole_request_of_each_framing_is_complete_once_its_last_byte_is_in(data, method, body, step):
    request = fed(data[:-1], step=step)
    assert request.progress is Progress.NEED_MORE
    assert request.feed(data[-1:]) is Progress.COMPLETE
    assert as_gunicorn_reads(request) == (method, body)
    assert request.leftover == b""


@pytest.mark.parametrize("first", [GET, POST, CHUNKED])
def test_a_pipelined_next_request_is_left_over_not_read(first):
    second_start = b"GET /v1/jobs HTTP/1.1\r\nHo"
    request = fed(first + second_start)
    assert request.progress is Progress.COMPLETE
    assert request.leftover == second_start
    assert as_gunicorn_reads(request)[0] in ("GET", "POST")
    # The next request starts from what was left over, and is whole once the rest comes.
    following = IncomingRequest(Config(), 1 << 20, leftover=request.leftover)
    assert following.progress is Progress.NEED_MORE
    assert following.feed(b"st: x\r\n\r\n") is Progress.COMPLETE


def test_expect_continue_is_the_loops_to_answer_and_gunicorn_does_not_see_it():
    head = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    request = fed(head)
    assert request.progress is Progress.NEED_MORE and request.wants_continue
    assert request.feed(b"hello") is Progress.COMPLETE
    parser = RequestParser(Config(), request.source(), ("127.0.0.1", 1))
    message = next(parser)
    assert not message._expected_100_continue
    assert message.body.read() == b"hello"


def test_a_declared_length_past_the_cap_stops_at_the_head_and_asks_for_no_body():
    head = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2000\r\n\r\n"
    request = fed(head, max_body=1000)
    assert request.progress is Progress.OVERSIZED and not request.wants_continue


def test_a_chunked_body_past_the_cap_stops_with_more_than_the_cap_for_the_view_to_refuse():
    head = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    request = fed(head, max_body=1000)
    while request.progress is Progress.NEED_MORE:
        request.feed(b"64\r\n" + b"x" * 100 + b"\r\n")
    assert request.progress is Progress.OVERSIZED and request.body_bytes > 1000


def test_a_large_body_is_kept_on_disk_and_read_back_whole():
    body = bytes(range(256)) * (3 * IN_MEMORY_BODY_BYTES // 256)
    data = b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    request = fed(data, step=65536, max_body=len(body))
    assert request.progress is Progress.COMPLETE
    assert request._body._rolled  # past the in-memory size: a temporary file, not memory
    assert as_gunicorn_reads(request) == ("POST", body)


@pytest.mark.parametrize("data, error", [
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n", errors.InvalidHeader),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: " + b"y" * (200 * 1024), errors.LimitRequestHeaders),
    (b"GET / HTTP/1.1\r\nHost: x\nX-Next: ", errors.InvalidHeader),  # a bare LF: at once, not at the head's end
    (b"GET /" + b"a" * 5000, errors.LimitRequestLine),  # a request line past its limit: at once
    (CHUNKED.replace(b"3\r\n", b"3 \r\n"), errors.InvalidChunkSize),
    (CHUNKED.replace(b"3\r\n", b"3;\r\n"), errors.InvalidChunkExtension),
    (CHUNKED[:-2] + b"Content-Length: 5\r\n\r\n", errors.InvalidHeaderName),
    (CHUNKED.split(b"\r\n\r\n")[0] + b"\r\n\r\nFFFFFFFFFFFFFFFFFFFF\r\n", errors.InvalidChunkSize),
])
@pytest.mark.parametrize("step", [None, 1])
def test_what_gunicorn_refuses_is_invalid_with_its_error(data, error, step):
    request = fed(data, step=step)
    assert request.progress is Progress.INVALID and isinstance(request.error, error)


def test_a_chunk_size_past_the_cap_is_oversized_at_once_and_handed_on_declaring_past_it():
    head = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    request = fed(head + b"100000\r\nab", max_body=1000)
    assert request.progress is Progress.OVERSIZED
    parser = RequestParser(Config(), request.source(), ("127.0.0.1", 1))
    assert next(parser).body.reader.length == 0x100000


def test_a_chunked_request_is_handed_on_with_its_length_and_no_framing():
    request = fed(CHUNKED.replace(b"Host: x\r\n", b"Host: x\r\nExpect: 100-continue\r\n"))
    head = request.source().recv(1 << 20)
    assert head == b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"


def test_the_key_and_the_routed_path_are_gunicorns_reading():
    request = fed(b"GET http://x/heal%74hz?a=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                  b"authorization: Bearer j\r\n\r\n")
    assert request.path == "/healthz"
    assert request.authorization == "Bearer k,Bearer j"  # repeated: joined, as the app gets it


def test_the_source_ends_where_the_request_ends_so_a_thread_never_waits_for_more():
    request = fed(POST)
    source = request.source()
    assert source.recv(1 << 20) + source.recv(1 << 20) == POST
    assert source.recv(1) == b""
