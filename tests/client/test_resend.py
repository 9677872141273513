"""A submit whose connection closes before its answer is sent again and made once: the client against
the real API (Flask app, real Redis and broker, no workers: jobs stay queued) behind a loopback proxy
that closes a connection unanswered, before the request reaches the API (the server closed an idle
kept-alive connection under it) or after (the answer was lost)."""

from __future__ import annotations

import socket
import threading

import pytest
import redis
from rollout_queue_client import ConnectionFailedError, RetryPolicy, RolloutClient
from werkzeug.serving import make_server

from domain.settings import Settings
from tests.conftest import db_url
from web.app import create_app

KEY = "client-resend-key"
PROMPT = {"token_ids": [100, 101, 102], "sampling_params": {"max_tokens": 4, "seed": 1}}


def read_message(sock: socket.socket) -> bytes:
    """One HTTP/1.1 message (head and Content-Length body) from ``sock``; b"" at EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


class DroppingProxy:
    """Forwards each connection's requests to the API, except that the connections ``plan`` names in
    turn close unanswered: ``"drop"`` before the request reaches the API, ``"lose_answer"`` after the
    API answered it."""

    def __init__(self, target: tuple[str, int], plan: list[str]):
        self.target, self.plan = target, list(plan)
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def keys(self) -> list[str]:
        return [line.split(b":", 1)[1].strip().decode() for request in self.requests
                for line in request.split(b"\r\n\r\n")[0].split(b"\r\n") if line.lower().startswith(b"idempotency-key:")]

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.target) as upstream:
            while request := read_message(client):
                self.requests.append(request)
                action = self.plan.pop(0) if self.plan else "forward"
                if action == "drop":
                    return
                upstream.sendall(request)
                answer = read_message(upstream)
                if action == "lose_answer":
                    return
                client.sendall(answer)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def api(redis_url, demo_model_dir, tmp_path_factory):
    url = db_url(redis_url, 2)  # the API tests' database, emptied by each test below
    settings = Settings(state_dir=tmp_path_factory.mktemp("resend"), model=str(demo_model_dir), api_keys=(KEY,))
    server = make_server("127.0.0.1", 0, create_app(settings, url), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield ("127.0.0.1", server.server_port), url
    server.shutdown()


@pytest.fixture
def through(api):
    target, url = api
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    proxies = []

    def make(*plan: str) -> DroppingProxy:
        proxies.append(DroppingProxy(target, list(plan)))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.close()


def listed(client: RolloutClient) -> list[str]:
    return [job["id"] for job in client._request("GET", "/v1/jobs", params={"limit": 100}, idempotent=True).json()["data"]]


@pytest.mark.parametrize("lost", ["drop", "lose_answer"])
def test_a_submit_whose_connection_closed_unanswered_is_sent_again_and_made_once(through, lost):
    proxy = through(lost)
    with RolloutClient(proxy.url, api_key=KEY, retry=RetryPolicy(backoff=0.01)) as client:
        job = client.submit(PROMPT)
        assert job["status"] == "queued"
        assert listed(client) == [job["id"]]  # neither dropped nor made twice
    first, again, _listing = proxy.keys() + [None] * (3 - len(proxy.keys()))
    assert len(proxy.requests) == 3 and first == again and first is not None


def test_a_bulk_submit_whose_answer_was_lost_is_made_once(through):
    proxy = through("lose_answer")
    with RolloutClient(proxy.url, api_key=KEY, retry=RetryPolicy(backoff=0.01)) as client:
        jobs = client.submit_many([PROMPT, {**PROMPT, "token_ids": [100, 101, 103]}, PROMPT])
        assert len({job["id"] for job in jobs}) == 3
        assert sorted(listed(client)) == sorted(job["id"] for job in jobs)
    assert proxy.keys()[0] == proxy.keys()[1]


def test_tries_that_all_lost_their_answers_made_one_job(through):
    # Every try's connection closed unanswered: the client gives up with a ConnectionFailedError, and
    # the tries that reached the API made one job between them.
    proxy = through("drop", "lose_answer", "lose_answer")
    with RolloutClient(proxy.url, api_key=KEY, retry=RetryPolicy(max_retries=2, backoff=0.01)) as client:
        with pytest.raises(ConnectionFailedError):
            client.submit(PROMPT)
        assert len(listed(client)) == 1
    assert len(set(proxy.keys()[:3])) == 1
