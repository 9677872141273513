"""One HTTP grammar (#56 item 5): every framing of the catalogue (``http_catalogue.py``) sent over
a real socket to the API under gunicorn as deployed gets exactly one answer: a refused framing its
early status in the JSON error shape, no traceback, and the connection closed (the pipelined
request behind it unanswered); a taken one the route's answer, then the pipelined request's."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from tests.conftest import empty_db_url
from tests.web.gunicorn_api import gunicorn_api
from tests.web.serving.http_catalogue import CATALOGUE, REFUSED, TAKEN, Framing

pytestmark = pytest.mark.stack  # the API under gunicorn (README "Tests")

NEXT = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def port(redis_url, demo_model_dir, tmp_path_factory):
    with gunicorn_api(empty_db_url(redis_url, 10), demo_model_dir, tmp_path_factory.mktemp("grammar-state"),
                      request_read_timeout="3") as (_url, port):
        yield port


def exchange(port: int, data: bytes) -> bytes:
    """What the server sends back until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (chunk := sock.recv(65536)):
            received += chunk
    return received


def statuses(received: bytes) -> list[int]:
    return [int(s) for s in re.findall(rb"HTTP/1\.\d (\d{3}) ", received)]


def test_the_catalogue_is_large_and_its_names_unique():
    assert len(CATALOGUE) > 80 and len({f.name for f in CATALOGUE}) == len(CATALOGUE)
    assert len(REFUSED) > 60


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
@pytest.mark.parametrize("framing", REFUSED, ids=lambda f: f.name)
def test_a_refused_framing_gets_one_early_answer_and_the_connection_closes(port, framing: Framing, keyed):
    received = exchange(port, framing.request(keyed) + NEXT)
    assert statuses(received) == [framing.status], received[:600]
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"\r\nConnection: close\r\n" in head + b"\r\n"
    assert b"Traceback" not in received
    assert json.loads(body)["code"]


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
@pytest.mark.parametrize("framing", TAKEN, ids=lambda f: f.name)
def test_a_taken_framing_is_answered_by_its_route_then_the_next_request(port, framing: Framing, keyed):
    received = exchange(port, framing.request(keyed) + NEXT)
    route = 202 if keyed else 401
    got = statuses(received)
    if b" HTTP/1.0\r\n" in framing.head:  # HTTP/1.0 without keep-alive: closed after the answer
        assert got == [route], received[:600]
    else:
        assert got[:1] == [route] and len(got) == 2 and got[1] in (200, 503), received[:600]
    assert b"Traceback" not in received
