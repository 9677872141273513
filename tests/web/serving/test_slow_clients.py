"""Slow senders cost a socket, not a thread (web/serving/request_buffering.py): under gunicorn as deployed,
200 sockets of each slow kind (a head that never ends, a declared or chunked body that trickles,
a request waiting for 100 Continue that never sends its body, a whole request followed by the
start of a second), with no key, leave every ordinary request answering in under a second, and
each of them is dropped with a 408 once ROLLOUT_REQUEST_READ_TIMEOUT passes."""

from __future__ import annotations

import re
import socket
import time

import pytest
import requests

from tests.conftest import empty_db_url
from tests.web.conftest import auth
from tests.web.gunicorn_api import gunicorn_api

pytestmark = pytest.mark.stack  # the API under gunicorn (README "Tests")

READ_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def api(redis_url, demo_model_dir, tmp_path_factory):
    # Few threads, so that before the fix 200 slow sockets would hold every one of them.
    with gunicorn_api(empty_db_url(redis_url, 19), demo_model_dir, tmp_path_factory.mktemp("slow-state"),
                      api_threads="4", api_stream_slots="4", request_read_timeout=str(READ_TIMEOUT)) as (url, port):
        yield url, port


JOB_HEAD = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
# What each slow socket sends, then nothing more; and the answers it gets before its 408.
SLOW_KINDS = {
    "head that never ends": (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ", 0),
    "declared body that trickles": (JOB_HEAD + b"Content-Length: 100000\r\n\r\n{", 0),
    "chunked body that trickles": (JOB_HEAD + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n", 0),
    "expect 100-continue, no body": (JOB_HEAD + b"Expect: 100-continue\r\nContent-Length: 10\r\n\r\n", 0),
    "whole request, then a second head begun": (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTT", 1),
}


def _slow_sockets(port: int, count: int, first_bytes: bytes) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(first_bytes)
        sockets.append(sock)
    return sockets


def _statuses(received: bytes) -> list[bytes]:
    """The status of each response in what a connection received, in order."""
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", received)


def _read_to_close(sock: socket.socket, deadline: float) -> bytes:
    sock.settimeout(max(0.1, deadline - time.monotonic()))
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


@pytest.mark.parametrize("kind", SLOW_KINDS)
def test_200_slow_sockets_leave_ordinary_requests_fast_and_are_dropped_with_a_408(api, kind):
    url, port = api
    first_bytes, answered_first = SLOW_KINDS[kind]
    slow = _slow_sockets(port, 200, first_bytes)
    try:
        time.sleep(0.5)  # every slow socket connected and sent its first bytes
        for _ in range(5):
            started = time.monotonic()
            assert requests.get(f"{url}/healthz", timeout=5).status_code in (200, 503)
            assert requests.get(f"{url}/v1/jobs", headers=auth(), timeout=5).status_code == 200
            assert time.monotonic() - started < 1.0
        # Each slow request is answered 408 and closed once the read timeout passes (after the
        # answers it was owed: 100 Continue, or the whole request before the one begun).
        deadline = time.monotonic() + READ_TIMEOUT + 5
        for sock in slow:
            received = _read_to_close(sock, deadline)
            if b"100-continue" in first_bytes:
                assert received.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), received[:100]
                received = received.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
            statuses = _statuses(received)
            assert statuses[answered_first:] == [b"408"] and len(statuses) == answered_first + 1, received
            assert b'"code": "request_timeout"' in received
    finally:
        for sock in slow:
            sock.close()


def test_pipelined_requests_are_each_answered_in_order(api):
    _url, port = api
    jobs = f"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: {auth()['Authorization']}\r\n\r\n".encode()
    last = jobs.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n")  # the server closes after it
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + jobs + last[:20])
        time.sleep(0.3)
        sock.sendall(last[20:])
        received = _read_to_close(sock, time.monotonic() + 10)
    statuses = _statuses(received)
    assert statuses[1:] == [b"200", b"200"] and statuses[0] in (b"200", b"503"), received


def test_expect_100_continue_is_answered_then_the_body_is_taken(api):
    _url, port = api
    body = b'{"prompt": "hi", "sampling_params": {"max_tokens": 2}}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(JOB_HEAD + f"Authorization: {auth()['Authorization']}\r\nExpect: 100-continue\r\n"
                     f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        assert sock.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        received = _read_to_close(sock, time.monotonic() + 10)
    assert received.startswith(b"HTTP/1.1 202"), received[:300]
    assert b"100 Continue" not in received  # one interim answer, the loop's, not a second from gunicorn


def test_a_request_sent_slowly_but_within_the_timeout_is_served(api):
    url, port = api
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for piece in (b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n", f"Authorization: {auth()['Authorization']}\r\n".encode(),
                      b"Connection: close\r\n\r\n"):
            sock.sendall(piece)
            time.sleep(0.3)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200")
