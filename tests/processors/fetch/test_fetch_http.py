"""Allowed fetches work; limits, deadlines, retries and DNS pinning hold."""

from __future__ import annotations

import base64
import gzip
import logging
import socket
import time

import pytest

from engine.errors import Fault
from processors.decode import decode_image
from processors.fetch import (
    FetchPolicy,
    GuardedFetcher,
    MediaBlockedError,
    MediaDecodeError,
    MediaFetchError,
    MediaRejectedError,
    MediaTimeoutError,
    MediaTooLargeError,
    log_policy_warnings,
)


def test_image_over_http_keeps_host_header_and_pins_address(
    make_fetcher, servers, connects, make_image
) -> None:
    png = make_image()
    servers.public.reply("/img.png", body=png, headers={"Content-Type": "image/png"})
    got = make_fetcher().fetch(f"http://MEDIA.test.:{servers.port}/img.png?v=1#frag")
    assert got.data == png and got.content_type == "image/png"
    assert got.url == f"http://media.test:{servers.port}/img.png?v=1"
    assert decode_image(got.data, max_pixels=10_000).size == (64, 48)
    seen = servers.public.seen[0]
    assert seen.headers["Host"] == f"media.test:{servers.port}"
    assert seen.path == "/img.png?v=1"
    assert connects == [("127.0.0.1", servers.port)]


def test_data_and_file_urls(make_fetcher, media_root, make_image) -> None:
    fetcher = make_fetcher(max_data_url_bytes=1_000_000)
    png = make_image()
    got = fetcher.fetch("data:image/png;base64," + base64.b64encode(png).decode())
    assert got.data == png and got.content_type == "image/png"
    for name in ("img.png", "inside_link.png", "sub/../img.png"):
        got = fetcher.fetch(f"file://{media_root}/{name}")
        assert got.data == png and got.content_type == "image/png"
        assert got.url == (media_root / "img.png").as_uri()


def test_file_over_the_byte_cap(make_fetcher, media_root) -> None:
    with pytest.raises(MediaTooLargeError):
        make_fetcher(max_bytes=10).fetch(f"file://{media_root}/img.png")


def test_redirects_within_the_rules_are_followed(make_fetcher, servers, resolver) -> None:
    servers.public.redirect("/a", "/b", 301)
    servers.public.redirect("/b", f"http://www.cdn.test:{servers.port}/c", 307)
    servers.public.reply("/c", body=b"media")
    fetcher = make_fetcher(allowed_domains=("media.test", "*.cdn.test"))
    got = fetcher.fetch(f"http://media.test:{servers.port}/a")
    assert got.data == b"media" and got.url == f"http://www.cdn.test:{servers.port}/c"
    assert [s.headers["Host"] for s in servers.public.seen] == [
        f"media.test:{servers.port}",
        f"media.test:{servers.port}",
        f"www.cdn.test:{servers.port}",
    ]
    assert resolver.calls == ["media.test", "media.test", "www.cdn.test"]  # once per hop


def test_redirect_limit(make_fetcher, servers) -> None:
    servers.public.redirect("/loop", "/loop")
    with pytest.raises(MediaBlockedError) as info:
        make_fetcher(max_redirects=3).fetch(f"http://media.test:{servers.port}/loop")
    assert info.value.reason == "redirect"
    assert servers.public.count == 4


def test_redirect_to_https_is_a_scheme_change(make_fetcher, servers) -> None:
    servers.public.redirect("/up", f"https://media.test:{servers.port}/img.png")
    with pytest.raises(MediaBlockedError) as info:
        make_fetcher().fetch(f"http://media.test:{servers.port}/up")
    assert info.value.reason == "scheme" and servers.public.count == 1


def test_gzip_body_is_decoded(make_fetcher, servers) -> None:
    body = b"pixels" * 1000
    servers.public.reply("/gz", body=gzip.compress(body), headers={"Content-Encoding": "gzip"})
    assert make_fetcher().fetch(f"http://media.test:{servers.port}/gz").data == body
    assert "gzip" in servers.public.seen[0].headers["Accept-Encoding"]


def test_gzip_bomb_stops_at_the_cap(make_fetcher, servers) -> None:
    bomb = gzip.compress(b"\0" * (64 * 1024 * 1024), compresslevel=9)  # ~64 KiB on the wire
    assert len(bomb) < 100_000
    servers.public.reply("/bomb", body=bomb, headers={"Content-Encoding": "gzip"})
    started = time.monotonic()
    with pytest.raises(MediaTooLargeError):
        make_fetcher(max_bytes=1024 * 1024).fetch(f"http://media.test:{servers.port}/bomb")
    assert time.monotonic() - started < 2


def test_huge_content_length_is_refused_before_reading(make_fetcher, servers) -> None:
    servers.public.reply("/huge", body=b"tiny", headers={"Content-Length": str(10**12)})
    with pytest.raises(MediaTooLargeError):
        make_fetcher().fetch(f"http://media.test:{servers.port}/huge")


def test_body_without_content_length_over_the_cap(make_fetcher, servers) -> None:
    def endless(req) -> None:
        req.send_response(200)
        req.end_headers()
        chunk = b"x" * 65536
        for _ in range(64):  # 4 MiB, no Content-Length, ended by closing
            req.wfile.write(chunk)

    servers.public.route("/stream", endless)
    with pytest.raises(MediaTooLargeError):
        make_fetcher(max_bytes=1024 * 1024).fetch(f"http://media.test:{servers.port}/stream")


def _drip(head: bytes, body_bytes: int, gap: float):
    """Headers byte by byte (slowly when there is no body to drip), then the body slowly."""

    def handler(req) -> None:
        req.close_connection = True
        for byte in head:
            req.wfile.write(bytes([byte]))
            req.wfile.flush()
            if not body_bytes:
                time.sleep(gap)
        for _ in range(body_bytes):
            req.wfile.write(b"x")
            req.wfile.flush()
            time.sleep(gap)

    return handler


@pytest.mark.parametrize(
    ("where", "head", "body_bytes"),
    [
        ("body", b"HTTP/1.0 200 OK\r\nContent-Length: 400\r\n\r\n", 400),
        ("body_no_length", b"HTTP/1.0 200 OK\r\n\r\n", 400),
        ("headers", b"HTTP/1.0 200 OK\r\nX-Slow: " + b"y" * 400 + b"\r\n\r\n", 0),
    ],
    ids=["body", "body_no_length", "headers"],
)
def test_slow_drip_hits_the_total_deadline(make_fetcher, servers, where, head, body_bytes) -> None:
    servers.public.route("/drip", _drip(head, body_bytes, 0.02))
    fetcher = make_fetcher(total_timeout=0.6, retries=2)
    started = time.monotonic()
    with pytest.raises(MediaTimeoutError) as info:
        fetcher.fetch(f"http://media.test:{servers.port}/drip")
    assert 0.5 < time.monotonic() - started < 1.5
    assert info.value.retryable
    assert servers.public.count == 1  # no retry once the whole budget is spent


def test_5xx_then_200_is_retried(make_fetcher, servers) -> None:
    answers = [503, 502, 200]

    def flaky(req) -> None:
        status = answers.pop(0)
        servers.public.respond(req, status, b"ok" if status == 200 else b"busy")

    servers.public.route("/flaky", flaky)
    assert make_fetcher(retries=2).fetch(f"http://media.test:{servers.port}/flaky").data == b"ok"
    assert servers.public.count == 3


def test_persistent_5xx_gives_up_after_the_retries(make_fetcher, servers) -> None:
    servers.public.reply("/down", 500)
    with pytest.raises(MediaFetchError) as info:
        make_fetcher(retries=2).fetch(f"http://media.test:{servers.port}/down")
    assert info.value.status == 500 and info.value.retryable
    assert servers.public.count == 3


@pytest.mark.parametrize("status", [403, 404, 410])
def test_4xx_is_not_retried(make_fetcher, servers, status) -> None:
    servers.public.reply("/no", status)
    with pytest.raises(MediaRejectedError) as info:
        make_fetcher(retries=2).fetch(f"http://media.test:{servers.port}/no")
    assert info.value.status == status and not info.value.retryable
    assert info.value.code == "media_rejected" and info.value.fault is Fault.INVALID
    assert servers.public.count == 1


def test_connection_refused_is_retried_then_a_fetch_error(make_fetcher, resolver) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    fetcher = make_fetcher(allowed_ports=(port,), retries=1)
    with pytest.raises(MediaFetchError) as info:
        fetcher.fetch(f"http://media.test:{port}/x")
    assert info.value.retryable and type(info.value) is MediaFetchError
    assert resolver.calls == ["media.test", "media.test"]


def test_dns_rebinding_connects_only_to_the_checked_address(
    make_fetcher, servers, resolver, connects, monkeypatch
) -> None:
    answers = iter([["127.0.0.1"]] + [["127.0.0.2"]] * 10)
    resolver.names["rebind.test"] = lambda: next(answers)
    real_getaddrinfo = socket.getaddrinfo

    def numeric_only(host, *args, **kwargs):
        # urllib3 must not resolve the name again behind our back.
        assert host != "rebind.test"
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", numeric_only)
    servers.public.reply("/img.png", body=b"checked")
    servers.internal.reply("/img.png", body=b"internal")
    got = make_fetcher().fetch(f"http://rebind.test:{servers.port}/img.png")
    assert got.data == b"checked"
    assert resolver.calls == ["rebind.test"]
    assert connects == [("127.0.0.1", servers.port)]
    assert servers.internal_count() == 0
    assert servers.public.seen[0].headers["Host"] == f"rebind.test:{servers.port}"
    # The next hop asks again, gets the internal answer and is refused before connecting.
    servers.public.redirect("/hop", f"http://rebind.test:{servers.port}/img.png")
    answers = iter([["127.0.0.1"], ["127.0.0.2"]])
    with pytest.raises(MediaBlockedError):
        make_fetcher().fetch(f"http://rebind.test:{servers.port}/hop")
    assert servers.internal_count() == 0


def test_proxy_environment_is_ignored(make_fetcher, servers, connects, monkeypatch) -> None:
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, f"http://127.0.0.2:{servers.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    servers.public.reply("/img.png", body=b"direct")
    assert make_fetcher().fetch(f"http://media.test:{servers.port}/img.png").data == b"direct"
    assert servers.internal_count() == 0 and connects == [("127.0.0.1", servers.port)]


def test_unknown_host_is_a_permanent_fetch_error(make_fetcher, servers) -> None:
    with pytest.raises(MediaRejectedError):
        make_fetcher().fetch(f"http://nowhere.test:{servers.port}/")


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        FetchPolicy(allow_networks=("127.0.0.1/33",))
    with pytest.raises(ValueError):
        FetchPolicy(allowed_ports=(0,))
    with pytest.raises(ValueError):
        FetchPolicy(allowed_domains=("bad_name.test",))
    assert FetchPolicy(max_bytes=10).max_data_url_bytes == 10
    assert FetchPolicy(allowed_domains=("*.CDN.Test.",)).domain_patterns == ("*.cdn.test",)


def test_policy_warnings(caplog) -> None:
    with caplog.at_level(logging.INFO):
        log_policy_warnings(FetchPolicy(), logging.getLogger("t"))
    assert any("any public host" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        log_policy_warnings(FetchPolicy(allowed_domains=("a.test",)), logging.getLogger("t"))
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_default_resolver_reads_numeric_spellings() -> None:
    from processors.fetch import system_resolver

    for spelling in ("2130706433", "0x7f.1", "0177.0.0.1", "127.1"):
        assert system_resolver(spelling, 80) == ["127.0.0.1"]
    fetcher = GuardedFetcher(FetchPolicy())  # the default resolver, the default policy
    with pytest.raises(MediaBlockedError) as info:
        fetcher.fetch("http://2130706433/")
    assert info.value.reason == "address"


def test_ipv6_literal_reachable_through_allow_networks(make_fetcher, servers, connects) -> None:
    if servers.internal6 is None:
        pytest.skip("no IPv6 loopback here")
    servers.internal6.reply("/img.png", body=b"v6")
    fetcher = make_fetcher(allow_networks=("::1/128",))
    assert fetcher.fetch(f"http://[::1]:{servers.port}/img.png").data == b"v6"
    assert servers.internal6.seen[0].headers["Host"] == f"[::1]:{servers.port}"
    assert connects == [("::1", servers.port)]


def test_oversized_data_url_is_refused_without_decoding(make_fetcher) -> None:
    url = "data:image/png;base64," + "QUFB" * (8 * 1024 * 1024)  # 32 MiB of base64
    started = time.monotonic()
    with pytest.raises(MediaTooLargeError):
        make_fetcher(max_data_url_bytes=1024).fetch(url)
    assert time.monotonic() - started < 0.2
    with pytest.raises(MediaDecodeError):  # blanks and control characters inside the payload
        make_fetcher().fetch("data:image/png;base64,AA\x00A")
