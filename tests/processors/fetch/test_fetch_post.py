"""post(): webhooks go out under the same address rules, once, and never follow redirects."""

from __future__ import annotations

import time

import pytest

from processors.fetch import MediaBlockedError, MediaTimeoutError


@pytest.fixture
def hook_fetcher(make_fetcher, servers):
    return make_fetcher(allow_networks=("127.0.0.0/8",), allowed_ports=(servers.port,))


def test_post_to_loopback_is_refused_by_default(make_fetcher, servers, connects) -> None:
    fetcher = make_fetcher(allow_networks=())
    for url in (f"http://127.0.0.1:{servers.port}/hook", f"http://media.test:{servers.port}/hook"):
        with pytest.raises(MediaBlockedError) as info:
            fetcher.post(url, b"{}", {"Content-Type": "application/json"})
        assert info.value.reason == "address"
    assert servers.public.count == 0 and connects == []


def test_post_with_allow_networks_delivers(hook_fetcher, servers) -> None:
    servers.public.reply("/hook", 200, b"thanks", {"X-Reply": "1"})
    resp = hook_fetcher.post(
        f"http://127.0.0.1:{servers.port}/hook",
        b'{"id": 1}',
        {"Content-Type": "application/json", "Host": "x"},
    )
    assert resp.status == 200 and resp.body == b"thanks" and resp.headers["X-Reply"] == "1"
    assert resp.elapsed > 0
    seen = servers.public.seen[0]
    assert seen.method == "POST" and seen.body == b'{"id": 1}'
    assert seen.headers["Content-Type"] == "application/json"
    assert seen.headers["Host"] == f"127.0.0.1:{servers.port}"  # the caller cannot move the Host


def test_post_port_is_still_checked(make_fetcher, servers) -> None:
    fetcher = make_fetcher(allow_networks=("127.0.0.0/8",), allowed_ports=(80,))
    with pytest.raises(MediaBlockedError) as info:
        fetcher.post(f"http://127.0.0.1:{servers.port}/hook", b"", {})
    assert info.value.reason == "port" and servers.public.count == 0


@pytest.mark.parametrize("status", [200, 204, 302, 308, 410, 503])
def test_post_returns_statuses_without_following_or_retrying(hook_fetcher, servers, status) -> None:
    headers = {"Location": f"http://127.0.0.2:{servers.port}/stolen"} if status in (302, 308) else None
    servers.public.reply("/hook", status, b"" if status == 204 else b"body", headers)
    resp = hook_fetcher.post(f"http://media.test:{servers.port}/hook", b"{}", {})
    assert resp.status == status
    assert servers.public.count == 1 and servers.internal_count() == 0


@pytest.mark.parametrize("url", ["data:text/plain;base64,AA==", "file:///etc/passwd", "ftp://media.test/x"])
def test_post_is_http_only(hook_fetcher, url) -> None:
    with pytest.raises(MediaBlockedError) as info:
        hook_fetcher.post(url, b"", {})
    assert info.value.reason == "scheme"


def test_post_response_is_cut_at_the_cap(hook_fetcher, servers) -> None:
    servers.public.reply("/big", 200, b"z" * (1024 * 1024))
    resp = hook_fetcher.post(f"http://media.test:{servers.port}/big", b"", {})
    assert resp.status == 200 and resp.body == b"z" * (64 * 1024)


def test_post_total_deadline(make_fetcher, servers) -> None:
    def slow(req) -> None:
        time.sleep(1.0)
        servers.public.respond(req, 200)

    servers.public.route("/slow", slow)
    fetcher = make_fetcher(allow_networks=("127.0.0.0/8",), total_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(MediaTimeoutError):
        fetcher.post(f"http://media.test:{servers.port}/slow", b"", {})
    assert time.monotonic() - started < 0.9
    assert servers.public.count == 1
