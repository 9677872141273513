"""Many long-lived SSE streams under gunicorn (``rollout-queue api``) on loopback: 200 streams that
stay open do not starve ordinary requests, and a stream past the process's slots is refused."""

from __future__ import annotations

import socket
import time

import pytest
import requests

from tests.conftest import empty_db_url
from tests.web.conftest import KEY_A, auth
from tests.web.gunicorn_api import gunicorn_api

pytestmark = pytest.mark.stack  # the API under gunicorn (README "Tests")

STREAMS = 200


@pytest.fixture(scope="module")
def api_url(redis_url, demo_model_dir, tmp_path_factory):
    with gunicorn_api(empty_db_url(redis_url, 25), demo_model_dir, tmp_path_factory.mktemp("streams-state"),
                      api_threads="4", api_stream_slots=str(STREAMS), api_stream_slots_per_key=str(STREAMS),
                      stream_keepalive_seconds="1") as served:
        yield served


def open_stream(port: int, job_id: str) -> tuple[socket.socket, bytes]:
    """A raw stream on its own socket; its status line and first event."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\r\n"
                 .encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    return sock, head


def test_200_open_streams_leave_ordinary_requests_served(api_url):
    url, port = api_url
    # No GPU worker: each job stays queued and its stream stays open, idle but for keep-alives.
    ids = [requests.post(f"{url}/v1/jobs", headers=auth(KEY_A), timeout=30,
                         json={"token_ids": [100 + i % 50], "sampling_params": {"max_tokens": 2}}).json()["id"]
           for i in range(STREAMS + 1)]
    streams = []
    try:
        for job_id in ids[:STREAMS]:
            sock, head = open_stream(port, job_id)
            assert head.startswith(b"HTTP/1.1 200"), head[:200]
            streams.append(sock)
        # Every slot is taken: one more stream is refused at once rather than queued.
        refused = requests.get(f"{url}/v1/jobs/{ids[-1]}/events", headers=auth(KEY_A), timeout=10)
        assert refused.status_code == 503 and refused.json()["code"] == "too_many_streams"
        assert refused.headers["Retry-After"] == "1"
        took = []
        for job_id in ids[:20]:
            started = time.monotonic()
            answer = requests.get(f"{url}/v1/jobs/{job_id}", headers=auth(KEY_A), timeout=10)
            took.append(time.monotonic() - started)
            assert answer.status_code == 200 and answer.json()["status"] == "queued"
        # Wide margin for a loaded 2-core machine; starved requests would wait for a stream to end (never).
        assert max(took) < 3.0, took
        # The streams are alive: each gets its keep-alive comments.
        data = streams[0].recv(4096) + streams[-1].recv(4096)
        assert b"keep-alive" in data or b"event: status" in data
    finally:
        for sock in streams:
            sock.close()
    # Closed streams give their slots back.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with requests.get(f"{url}/v1/jobs/{ids[-1]}/events", headers=auth(KEY_A), timeout=10, stream=True) as again:
            if again.status_code == 200:
                break
        time.sleep(0.5)
    assert again.status_code == 200


def test_one_key_holds_at_most_its_share_of_the_slots():
    """A key's streams (or its readers that never read) leave the rest to other keys."""
    from web.api.streams import StreamSlots, TooManyStreamsError

    slots = StreamSlots(4, per_key=3)
    mine = [slots.take("key_a") for _ in range(3)]
    with pytest.raises(TooManyStreamsError) as refused:
        slots.take("key_a")
    assert refused.value.headers["Retry-After"] == "1" and "PER_KEY" in refused.value.message
    other = slots.take("key_b")
    with pytest.raises(TooManyStreamsError):  # all four taken
        slots.take("key_c")
    mine[0]()
    mine[0]()  # a second release of one slot gives back nothing more
    slots.take("key_a")
    with pytest.raises(TooManyStreamsError):
        slots.take("key_b")
    other()
    slots.take("key_b")
