"""Silent connections never stop accepts (#56 item 5, web/serving/request_buffering.py): under gunicorn
as deployed, a peer's sockets past ROLLOUT_API_CONNECTIONS_PER_PEER are closed as they are
accepted, the rest once ROLLOUT_REQUEST_FIRST_BYTE_TIMEOUT passes without a byte, and another
peer's /healthz is answered meanwhile. Before, 2,300 such sockets filled worker_connections and
/healthz timed out."""

from __future__ import annotations

import socket
import time

import pytest

from tests.conftest import empty_db_url
from tests.web.gunicorn_api import gunicorn_api

pytestmark = pytest.mark.stack  # the API under gunicorn (README "Tests")

PER_PEER = 40
FIRST_BYTE_S = 2.0
READ_S = 30.0  # far past the first-byte deadline: a socket closed before it was closed for silence
SILENT = 300


@pytest.fixture(scope="module")
def port(redis_url, demo_model_dir, tmp_path_factory):
    with gunicorn_api(empty_db_url(redis_url, 19), demo_model_dir, tmp_path_factory.mktemp("silent-state"),
                      api_threads="4", api_stream_slots="4", api_connections_per_peer=str(PER_PEER),
                      request_first_byte_timeout=str(FIRST_BYTE_S), request_read_timeout=str(READ_S)) as (_url, port):
        yield port


def closed_by_server(sock: socket.socket, wait: float) -> bool:
    """Whether the server closed ``sock`` (end of input or a reset) within ``wait`` seconds, having
    sent nothing."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def healthz_from(port: int, source: str) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return int(received.split(b" ", 2)[1])


def test_a_peers_silent_sockets_past_its_cap_are_closed_at_once_the_rest_after_the_first_byte_deadline(port):
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(SILENT)]
    try:
        time.sleep(0.5)  # the worker has accepted what it will
        # Another peer is answered while this one holds its cap (a generous bound: 10 s).
        assert healthz_from(port, "127.0.0.2") in (200, 503)
        closed_at_once = [sock for sock in silent if closed_by_server(sock, 0.01)]
        assert len(closed_at_once) >= SILENT - PER_PEER
        held = [sock for sock in silent if sock not in closed_at_once]
        # Each held one is closed, unanswered, once the first-byte deadline passes (long before READ_S).
        assert all(closed_by_server(sock, FIRST_BYTE_S + 10) for sock in held)
    finally:
        for sock in silent:
            sock.close()
    # The peer's own requests are served again.
    assert healthz_from(port, "127.0.0.1") in (200, 503)


def test_a_connection_that_sends_its_request_is_not_cut_by_the_first_byte_deadline(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        time.sleep(FIRST_BYTE_S + 1)  # past the first-byte deadline, within the read timeout
        sock.sendall(b"1\r\nConnection: close\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert int(received.split(b" ", 2)[1]) in (200, 503)
