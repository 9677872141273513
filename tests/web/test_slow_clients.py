"""Slow senders cost a socket, not a thread (web/request_buffering.py): under gunicorn as deployed,
200 sockets sending partial headers or trickling a declared body, with no key, leave every
ordinary request answering in under a second, and each of them is dropped with a 408 once
ROLLOUT_REQUEST_READ_TIMEOUT passes."""

from __future__ import annotations

import socket
import time

import pytest
import requests

from tests.conftest import empty_db_url
from tests.web.conftest import auth
from tests.web.gunicorn_api import gunicorn_api

READ_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def api(redis_url, demo_model_dir, tmp_path_factory):
    # Few threads, so that before the fix 200 slow sockets would hold every one of them.
    with gunicorn_api(empty_db_url(redis_url, 19), demo_model_dir, tmp_path_factory.mktemp("slow-state"),
                      api_threads="4", api_stream_slots="4", request_read_timeout=str(READ_TIMEOUT)) as (url, port):
        yield url, port


def _slow_sockets(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        if i % 2:  # a head that never ends
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        else:  # a declared body that trickles
            sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{")
        sockets.append(sock)
    return sockets


def test_200_slow_sockets_leave_ordinary_requests_fast_and_are_dropped_with_a_408(api):
    url, port = api
    slow = _slow_sockets(port, 200)
    try:
        time.sleep(0.5)  # every slow socket connected and sent its first bytes
        for _ in range(5):
            started = time.monotonic()
            assert requests.get(f"{url}/healthz", timeout=5).status_code in (200, 503)
            assert requests.get(f"{url}/v1/jobs", headers=auth(), timeout=5).status_code == 200
            assert time.monotonic() - started < 1.0
        # Each slow request is answered 408 and closed once the read timeout passes.
        deadline = time.monotonic() + READ_TIMEOUT + 5
        for sock in slow:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            received = b""
            while chunk := sock.recv(4096):
                received += chunk
            assert received.startswith(b"HTTP/1.1 408"), received[:100]
            assert b'"code": "request_timeout"' in received
    finally:
        for sock in slow:
            sock.close()


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
