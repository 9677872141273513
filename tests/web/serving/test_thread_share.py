"""API threads shared between keys (web/serving/thread_share.py, issue #47 item 4): one key's calls that
wait for their jobs hold at most its share of the threads, the rest of its calls waiting in the
event loop; another key, /healthz and admin calls still answer at once. Under gunicorn as deployed."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import pytest
import requests

from tests.conftest import empty_db_url
from tests.web.conftest import KEY_A, KEY_B, auth
from tests.web.gunicorn_api import gunicorn_api
from web.serving.thread_share import CONTROL_PATHS, Lane, ThreadShare, digests, key_digest, lane, request_key

pytestmark = pytest.mark.stack  # the API under gunicorn (README "Tests")

WAIT_S = 3  # each of A's synchronous calls waits this long for a job no worker runs


def test_a_free_thread_goes_to_the_waiting_key_holding_the_fewest_within_its_share():
    share = ThreadShare(threads=4, per_key=3)
    for i in range(5):
        share.add(b"a", f"a{i}")
    share.add(b"b", "b0")
    taken = [share.take() for _ in range(4)]
    assert [key for key, _ in taken] == [b"a", b"b", b"a", b"a"]  # b's first request comes second
    assert share.take() is None  # every thread taken
    share.done(b"b")
    assert share.take() is None  # a holds its share of 3: its other requests wait
    share.add(b"c", "c0")
    assert share.take() == (b"c", "c0")
    assert share.waiting == 2


def test_health_metrics_and_admin_control_calls_have_threads_of_their_own_admin_generation_does_not():
    assert lane("/healthz", False) is Lane.OPS and lane("/metrics", True) is Lane.OPS
    assert lane("/continue_generation", True) is Lane.CONTROL and lane("/v1/weights", True) is Lane.CONTROL
    assert lane("/continue_generation", False) is Lane.SHARE  # not an admin: refused in its share
    assert lane("/v1/generate", True) is Lane.SHARE and lane("/generate", True) is Lane.SHARE


def test_every_control_path_is_a_route_of_the_app(make_app):
    routes = {rule.rule for rule in make_app().url_map.iter_rules()}
    assert CONTROL_PATHS <= routes


@pytest.mark.parametrize("header", [f"Bearer {KEY_A}\xa0", f"Bearer {KEY_A}\x85", f"Bearer \xa0{KEY_A}",
                                    f"Bearer {KEY_A}x", f"Basic {KEY_A}", f"Bearer\t{KEY_A}", "Bearer made-up",
                                    f"Bearer {KEY_A},Bearer {KEY_A}", None])
def test_a_request_not_presenting_a_configured_key_exactly_waits_with_the_keyless(header):
    known = digests([KEY_A, KEY_B])
    assert request_key(header, known) == b""
    assert request_key(f"bearer   {KEY_A}", known) == key_digest(KEY_A)


@pytest.fixture(scope="module")
def api(redis_url, demo_model_dir, tmp_path_factory):
    # 8 threads, all but half the 4 ordinary ones (6) at most for one key. No workers: a synchronous
    # call waits out its timeout.
    with gunicorn_api(empty_db_url(redis_url, 6), demo_model_dir, tmp_path_factory.mktemp("share-state"),
                      api_keys=f"{KEY_A},{KEY_B}", api_threads="4", api_stream_slots="4") as (url, _port):
        yield url


def test_one_keys_waiting_calls_leave_threads_for_another_key_and_health(api):
    body = {"token_ids": [100, 101, 102], "sampling_params": {"max_tokens": 2}, "timeout": WAIT_S}
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        calls = [pool.submit(requests.post, f"{api}/v1/generate", json=body, headers=auth(KEY_A), timeout=60)
                 for _ in range(20)]
        time.sleep(1.0)  # A's calls arrived: 6 hold threads, 14 wait in the event loop
        for _ in range(3):
            started = time.monotonic()
            assert requests.get(f"{api}/healthz", timeout=5).status_code in (200, 503)
            assert requests.get(f"{api}/v1/jobs", headers=auth(KEY_B), timeout=5).status_code == 200
            assert time.monotonic() - started < 1.0
        # A's calls are all answered, a share at a time: the job, still queued, after WAIT_S each.
        assert [call.result().status_code for call in calls] == [202] * 20


ADMIN = "admin-key-secret"


@pytest.fixture(scope="module")
def admin_api(redis_url, demo_model_dir, tmp_path_factory):
    with gunicorn_api(empty_db_url(redis_url, 7), demo_model_dir, tmp_path_factory.mktemp("admin-share-state"),
                      api_keys=KEY_A, admin_keys=ADMIN, api_threads="4", api_stream_slots="4") as (url, port):
        yield url, port


def test_an_admins_generation_waits_in_its_share_while_its_control_calls_and_health_answer(admin_api):
    """#56 item 4: an admin's synchronous calls once ran on the two ops threads; six of them during a
    pause kept /healthz, /metrics and GET /v1/weights from answering, and /continue_generation, which
    they waited for, waited behind them."""
    url, port = admin_api
    admin = auth(ADMIN)
    assert requests.post(f"{url}/pause_generation", json={}, headers=admin, timeout=30).status_code == 200
    body = json.dumps({"token_ids": [100, 101], "sampling_params": {"max_tokens": 2}, "timeout": 120}).encode()
    calls = []
    for _ in range(8):  # more than the admin key's share: the last wait in the event loop
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {ADMIN}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        calls.append(sock)
    try:
        time.sleep(1.0)  # every call is waiting for its job, paused
        assert requests.get(f"{url}/healthz", timeout=10).status_code in (200, 503)
        assert requests.get(f"{url}/metrics", timeout=10).status_code == 200
        assert requests.get(f"{url}/v1/weights", headers=admin, timeout=10).json()["paused"] == "abort"
        assert requests.post(f"{url}/continue_generation", headers=admin, timeout=10).status_code == 200
        assert requests.get(f"{url}/v1/weights", headers=admin, timeout=10).json()["paused"] is None
    finally:
        for sock in calls:
            sock.close()  # the calls' client hung up: their jobs are cancelled
