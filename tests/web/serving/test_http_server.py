"""The API as deployed: ``rollout-queue api`` (gunicorn) on loopback, spoken to over real sockets.

Flask's test client cannot send a chunked body or a malformed request line, and gunicorn answers
some requests before the app sees them: both are checked here, where they happen.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
import requests

from tests.conftest import empty_db_url
from tests.web.conftest import auth
from tests.web.gunicorn_api import gunicorn_api

pytestmark = pytest.mark.stack  # the API under gunicorn (README "Tests")

MAX_BODY = 4096
BATCH_MAX = 8192


@pytest.fixture(scope="module")
def api_url(redis_url, demo_model_dir, tmp_path_factory):
    with gunicorn_api(empty_db_url(redis_url, 10), demo_model_dir, tmp_path_factory.mktemp("api-state"),
                      max_body_bytes=str(MAX_BODY), batch_max_bytes=str(BATCH_MAX)) as (url, _port):
        yield url


def chunked(data: bytes, size: int = 1000):
    """A generator body: requests sends it with Transfer-Encoding: chunked and no Content-Length."""
    for start in range(0, len(data), size):
        yield data[start:start + size]


def batch_file(lines: int) -> bytes:
    line = {"custom_id": "", "body": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}}
    return b"".join(json.dumps({**line, "custom_id": f"r{n}"}).encode() + b"\n" for n in range(lines))


def test_a_chunked_batch_over_the_limit_is_413_not_cut(api_url):
    data = batch_file(200)
    assert len(data) > BATCH_MAX
    response = requests.post(f"{api_url}/v1/batches", data=chunked(data),
                             headers={**auth(), "Content-Type": "application/jsonl"}, timeout=30)
    assert response.status_code == 413, response.text
    assert response.json()["code"] == "batch_too_large"
    assert requests.get(f"{api_url}/v1/batches", headers=auth(), timeout=10).json()["data"] == []


def test_a_chunked_batch_within_the_limit_is_taken_whole(api_url):
    data = batch_file(40)
    assert len(data) < BATCH_MAX
    response = requests.post(f"{api_url}/v1/batches", data=chunked(data),
                             headers={**auth(), "Content-Type": "application/jsonl"}, timeout=30)
    assert response.status_code == 202, response.text
    assert response.json()["request_counts"] == {"total": 40, "completed": 0, "failed": 0}


def test_a_chunked_multipart_batch_over_the_limit_is_413(api_url):
    data = batch_file(400)  # past the file limit and the multipart allowance around it
    body = (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.jsonl\"\r\n\r\n"
            + data + b"\r\n--b--\r\n")
    response = requests.post(f"{api_url}/v1/batches", data=chunked(body),
                             headers={**auth(), "Content-Type": "multipart/form-data; boundary=b"}, timeout=30)
    assert response.status_code == 413, response.text
    assert response.json()["code"] == "batch_too_large"


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/generate", "/v1/render"])
def test_a_chunked_json_body_over_the_limit_is_413(api_url, path):
    body = json.dumps({"prompt": "x" * (2 * MAX_BODY)}).encode()
    response = requests.post(f"{api_url}{path}", data=chunked(body),
                             headers={**auth(), "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 413, response.text
    assert response.json()["code"] == "payload_too_large"
    # The rest of the body is unread: the connection cannot carry another request, and says so
    # (it answered keep-alive, then dropped the client's next request).
    assert response.headers["Connection"] == "close"


def test_a_chunked_json_body_within_the_limit_is_taken(api_url):
    body = json.dumps({"prompt": "x" * (MAX_BODY // 2), "sampling_params": {"max_tokens": 2}}).encode()
    response = requests.post(f"{api_url}/v1/jobs", data=chunked(body, 100),
                             headers={**auth(), "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 202, response.text


def raw_request(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize("request_bytes, status, code", [
    (b"GET /v1/jobs?cursor=" + b"1" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
    (b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n", 400, "bad_request"),
    (b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % n for n in range(200)) + b"\r\n",
     431, "headers_too_large"),
    (b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Long: " + b"y" * 9000 + b"\r\n\r\n", 431, "headers_too_large"),
])
def test_requests_gunicorn_refuses_itself_are_answered_in_the_error_shape(api_url, request_bytes, status, code):
    got_status, headers, body = raw_request(api_url, request_bytes)
    assert got_status == status
    assert headers["Content-Type"] == "application/json"
    error = json.loads(body)
    assert error["code"] == code and error["message"]


def test_a_sync_dialect_call_whose_client_hangs_up_has_its_job_cancelled_under_gunicorn(api_url):
    # No workers here: the job would wait out ROLLOUT_SYNC_TIMEOUT_MAX (300 s) for nobody.
    body = json.dumps({"token_ids": [1, 2], "request_id": "hung-up", "sampling_params": {"max_tokens": 2}}).encode()
    host, port = api_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as client:
        client.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Authorization: {auth()['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                       + body)
        client.settimeout(0.5)
        with pytest.raises(TimeoutError):
            client.recv(1)
    deadline = time.monotonic() + 15
    while True:
        jobs = requests.get(f"{api_url}/v1/jobs", headers=auth(), timeout=10).json()["data"]
        mine = [job for job in jobs if job.get("request_id") == "hung-up"]
        if mine and mine[0]["status"] == "cancelled":
            break
        assert time.monotonic() < deadline, mine
        time.sleep(0.2)


def test_an_idle_kept_alive_connection_outlives_gunicorns_two_second_default(api_url):
    # A pooled client that sends 2-3 s after its last request (a trainer's step) finds its connection
    # open: gunicorn's default closed it at 2 s, and a send crossing the close failed.
    host, port = api_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", "/v1/jobs?limit=1", headers=auth())
        assert connection.getresponse().read() and connection.sock is not None
        first_socket = connection.sock
        time.sleep(3)
        connection.request("GET", "/v1/jobs?limit=1", headers=auth())  # RemoteDisconnected if it was closed
        response = connection.getresponse()
        assert response.status == 200 and response.read()
        assert connection.sock is first_socket  # the same connection, not a new one
    finally:
        connection.close()
