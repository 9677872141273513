"""The catalogue of URLs the guard must refuse, each tried directly and behind a 302.

Every case asserts the typed error (and for refusals the rule that refused it) and that nothing
reached the internal servers: not a request, not even a TCP connect to anything but the one
allowed public server (which sees exactly the one redirecting request in the 302 variant).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import pytest

from processors.fetch import (
    GuardedFetcher,
    MediaBlockedError,
    MediaDecodeError,
    MediaTooLargeError,
)

SAME = "same"  # behind a 302 the same error and reason
SCHEME = "scheme"  # behind a 302 refused for changing scheme (data:, file:)
# Behind a 302 this URL is not a refusal at all, or cannot be sent: a Location header cannot
# carry CR/LF, HTTP strips blanks around header values, and a scheme-less Location is a
# legitimate relative reference that resolves against the (allowed) redirecting URL.
DIRECT_ONLY = None


class Bad(NamedTuple):
    id: str
    url: str  # {port}: the allowed test port; {root}: the media root
    error: type[Exception]
    reason: str | None
    via_redirect: str | None = SAME  # SAME, SCHEME, DIRECT_ONLY, or another expected reason
    policy: str = "open"  # "open", "domains" (allowlist media.test, *.cdn.test), "no_root"


B = MediaBlockedError
CATALOGUE = [
    # schemes
    Bad("ftp", "ftp://media.test:{port}/img.png", B, "scheme"),
    Bad("gopher", "gopher://media.test:{port}/_GET%20/", B, "scheme"),
    Bad("dict", "dict://media.test:{port}/info", B, "scheme"),
    Bad("javascript", "javascript:alert(1)", B, "scheme"),
    Bad("jar", "jar:http://media.test:{port}/a.jar!/", B, "scheme"),
    Bad("no_scheme_path", "/etc/passwd", B, "scheme", DIRECT_ONLY),
    Bad("scheme_relative", "//127.0.0.2:{port}/", B, "scheme", "address"),
    Bad("file_remote_host", "file://media.test/etc/passwd", B, "file_path", SCHEME),
    # userinfo
    Bad("userinfo", "http://user:pw@media.test:{port}/img.png", B, "url"),
    Bad("userinfo_host_confusion", "http://media.test:{port}@127.0.0.2:{port}/", B, "url"),
    Bad("empty_userinfo", "http://@media.test:{port}/img.png", B, "url"),
    # backslashes
    Bad("backslash_authority", "http://media.test:{port}\\@127.0.0.2:{port}/", B, "url"),
    Bad("backslash_slashes", "http:\\\\127.0.0.2:{port}\\", B, "url"),
    # control characters and blanks
    Bad("nul", "http://media.test:{port}/img.png\x00", B, "url"),
    Bad("tab", "http://media.test:{port}/a\tb", B, "url"),
    Bad("crlf_header_injection", "http://media.test:{port}/\r\nX-Injected: 1", B, "url", DIRECT_ONLY),
    Bad("del", "http://media.test:{port}/\x7f", B, "url"),
    Bad("c1_control", "http://media.test:{port}/\x85", B, "url"),
    Bad("leading_blank", " http://127.0.0.2:{port}/", B, "url", DIRECT_ONLY),
    Bad("trailing_blank", "http://127.0.0.2:{port}/ ", B, "url", DIRECT_ONLY),
    # host names and IDNA
    Bad("bad_punycode", "http://xn--a.test:{port}/", B, "host"),
    Bad("empty_punycode", "http://xn--:{port}/", B, "host"),
    Bad("underscore_host", "http://in_ternal.test:{port}/", B, "host"),
    Bad("fullwidth_localhost", "http://ｌｏｃａｌｈｏｓｔ:{port}/", B, "url"),
    Bad("zero_width_joiner", "http://local\u200dhost:{port}/", B, "url"),
    Bad("percent_encoded_host", "http://127%2e0%2e0%2e2:{port}/", B, "address"),
    Bad("trailing_dot_localhost", "http://localhost.:{port}/", B, "address"),
    Bad("uppercase_localhost", "http://LOCALHOST:{port}/", B, "address"),
    # loopback, in every spelling (127.0.0.2 is where the internal server listens)
    Bad("loopback_literal", "http://127.0.0.2:{port}/", B, "address"),
    Bad("localhost_name", "http://localhost:{port}/", B, "address"),
    Bad("internal_name", "http://internal.test:{port}/", B, "address"),
    Bad("decimal_dword", "http://2130706434:{port}/", B, "address"),
    Bad("hex_dword", "http://0x7f000002:{port}/", B, "address"),
    Bad("hex_short", "http://0x7f.2:{port}/", B, "address"),
    Bad("octal", "http://0177.0.0.2:{port}/", B, "address"),
    Bad("short_form", "http://127.2:{port}/", B, "address"),
    Bad("zero_padded", "http://127.000.000.002:{port}/", B, "address"),
    Bad("ipv6_loopback", "http://[::1]:{port}/", B, "address"),
    # unspecified (connects to the local host on Linux)
    Bad("zero", "http://0:{port}/", B, "address"),
    Bad("unspecified_v4", "http://0.0.0.0:{port}/", B, "address"),
    Bad("unspecified_v6", "http://[::]:{port}/", B, "address"),
    # IPv6 forms that embed IPv4
    Bad("v4_mapped", "http://[::ffff:127.0.0.2]:{port}/", B, "address"),
    Bad("v4_mapped_hex", "http://[::ffff:7f00:2]:{port}/", B, "address"),
    Bad("v4_mapped_metadata", "http://[::ffff:169.254.169.254]:{port}/", B, "address"),
    Bad("sixtofour", "http://[2002:7f00:2::1]:{port}/", B, "address"),
    Bad("nat64", "http://[64:ff9b::7f00:2]:{port}/", B, "address"),
    Bad("teredo", "http://[2001:0:4136:e378:8000:63bf:80ff:fffd]:{port}/", B, "address"),
    Bad("mapped_by_dns", "http://mapped.test:{port}/", B, "address"),
    # private, link-local, metadata, CGNAT, multicast, reserved, special-purpose
    Bad("private_10", "http://10.0.0.1:{port}/", B, "address"),
    Bad("private_172", "http://172.16.0.1:{port}/", B, "address"),
    Bad("private_192", "http://192.168.1.1:{port}/", B, "address"),
    Bad("metadata_literal", "http://169.254.169.254:{port}/latest/meta-data/", B, "address"),
    Bad("metadata_name", "http://metadata.test:{port}/latest/meta-data/", B, "address"),
    Bad("cgnat", "http://100.64.0.1:{port}/", B, "address"),
    Bad("multicast_v4", "http://224.0.0.1:{port}/", B, "address"),
    Bad("reserved_v4", "http://240.0.0.1:{port}/", B, "address"),
    Bad("broadcast", "http://255.255.255.255:{port}/", B, "address"),
    Bad("benchmarking", "http://198.18.0.1:{port}/", B, "address"),
    Bad("documentation", "http://192.0.2.1:{port}/", B, "address"),
    Bad("link_local_v6", "http://[fe80::1]:{port}/", B, "address"),
    Bad("link_local_v6_zone", "http://[fe80::1%25lo]:{port}/", B, "address"),
    Bad("site_local_v6", "http://[fec0::1]:{port}/", B, "address"),
    Bad("unique_local_v6", "http://[fc00::1]:{port}/", B, "address"),
    Bad("multicast_v6", "http://[ff02::1]:{port}/", B, "address"),
    Bad("one_bad_answer_of_two", "http://mixed.test:{port}/", B, "address"),
    Bad("private_by_dns", "http://private.cdn.test:{port}/", B, "address"),
    # ports
    Bad("port_ssh", "http://media.test:22/", B, "port"),
    Bad("port_default_80", "http://media.test/", B, "port"),
    Bad("port_zero", "http://media.test:0/", B, "port"),
    Bad("port_out_of_range", "http://media.test:65536/", B, "url"),
    # domain allowlist (media.test and *.cdn.test)
    Bad("other_domain", "http://evil.test:{port}/img.png", B, "domain", policy="domains"),
    Bad("allowed_as_prefix", "http://media.test.evil.test:{port}/img.png", B, "domain", policy="domains"),
    Bad("allowed_as_suffix", "http://evilmedia.test:{port}/img.png", B, "domain", policy="domains"),
    Bad("wildcard_apex", "http://cdn.test:{port}/img.png", B, "domain", policy="domains"),
    Bad("homoglyph", "http://mеdia.test:{port}/img.png", B, "domain", "url", "domains"),
    Bad("ip_literal_not_listed", "http://127.0.0.1:{port}/img.png", B, "domain", policy="domains"),
    Bad("decimal_not_listed", "http://2130706433:{port}/img.png", B, "domain", policy="domains"),
    # file: URLs
    Bad("file_outside_root", "file:///etc/passwd", B, "file_path", SCHEME),
    Bad("file_dotdot", "file://{root}/../secret.txt", B, "file_path", SCHEME),
    Bad("file_encoded_dotdot", "file://{root}/%2e%2e/secret.txt", B, "file_path", SCHEME),
    Bad("file_encoded_slash", "file://{root}/sub/..%2f..%2fsecret.txt", B, "file_path", SCHEME),
    Bad("file_symlink_out", "file://{root}/escape.png", B, "file_path", SCHEME),
    Bad("file_directory", "file://{root}/", B, "file_path", SCHEME),
    Bad("file_without_root", "file://{root}/img.png", B, "file_path", SCHEME, "no_root"),
    # data: URLs (the test policy caps them at 1024 bytes)
    Bad("data_too_big", "data:image/png;base64," + "A" * 2000, MediaTooLargeError, None, SCHEME),
    Bad("data_not_base64", "data:text/plain,hello", B, "data_url", SCHEME),
    Bad("data_no_comma", "data:image/png;base64", B, "data_url", SCHEME),
    Bad("data_bad_base64", "data:image/png;base64,@@@@", MediaDecodeError, None, SCHEME),
    Bad("data_base64_whitespace", "data:image/png;base64,QUJD QUJD", MediaDecodeError, None, SCHEME),
    Bad("data_base64_padding_past_the_end", "data:image/png;base64,QUJD=", MediaDecodeError, None, SCHEME),
]


def _fetcher(case: Bad, make_fetcher) -> GuardedFetcher:
    if case.policy == "domains":
        return make_fetcher(allowed_domains=("media.test", "*.cdn.test"))
    if case.policy == "no_root":
        return make_fetcher(media_root=None)
    return make_fetcher()


def _url(case: Bad, servers, media_root) -> str:
    return case.url.replace("{port}", str(servers.port)).replace("{root}", str(media_root))


def _assert_nothing_reached(servers, connects, *, redirects: int) -> None:
    assert servers.internal_count() == 0
    assert servers.public.count == redirects
    assert all(c == ("127.0.0.1", servers.port) for c in connects), connects


def test_catalogue_is_big_enough() -> None:
    assert len(CATALOGUE) >= 40
    assert len({c.id for c in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_refused_directly(case: Bad, make_fetcher, servers, connects, media_root, resolver) -> None:
    with pytest.raises(case.error) as info:
        _fetcher(case, make_fetcher).fetch(_url(case, servers, media_root))
    if case.reason is not None:
        assert info.value.reason == case.reason
    _assert_nothing_reached(servers, connects, redirects=0)
    assert connects == []
    # A refused name's addresses never show up in what a client is told.
    if case.reason == "address" and "[" not in case.url:
        assert not any(ip in info.value.message for ip in ("127.0.0.2", "169.254", "10.0.0.1"))


REDIRECTED = [c for c in CATALOGUE if c.via_redirect is not DIRECT_ONLY]


@pytest.mark.parametrize("case", REDIRECTED, ids=[c.id for c in REDIRECTED])
def test_refused_behind_a_redirect(case: Bad, make_fetcher, servers, connects, media_root) -> None:
    servers.public.redirect("/go", _url(case, servers, media_root))
    fetcher = _fetcher(case, make_fetcher)
    with pytest.raises(MediaBlockedError) as info:
        fetcher.fetch(f"http://media.test:{servers.port}/go")
    expected = {SAME: case.reason, SCHEME: "scheme"}.get(case.via_redirect, case.via_redirect)
    assert info.value.reason == expected
    assert not info.value.retryable
    _assert_nothing_reached(servers, connects, redirects=1)


def test_the_allowed_server_itself_is_refused_without_allow_networks(make_fetcher, servers, connects) -> None:
    servers.public.reply("/img.png", body=b"x")
    with pytest.raises(MediaBlockedError) as info:
        make_fetcher(allow_networks=()).fetch(f"http://media.test:{servers.port}/img.png")
    assert info.value.reason == "address"
    assert servers.public.count == 0 and connects == []


def test_refusals_are_not_retried(make_fetcher, servers, resolver) -> None:
    with pytest.raises(MediaBlockedError):
        make_fetcher(retries=5).fetch(f"http://metadata.test:{servers.port}/")
    assert resolver.calls == ["metadata.test"]


def test_refusal_needs_no_resolver_for_scheme_domain_and_port(make_fetcher, servers, resolver) -> None:
    fetcher = make_fetcher(allowed_domains=("media.test",))
    for url in ("ftp://media.test/", f"http://evil.test:{servers.port}/", "http://media.test:22/"):
        with pytest.raises(MediaBlockedError):
            fetcher.fetch(url)
    assert resolver.calls == []


def test_policy_replace_keeps_parsed_fields(policy) -> None:
    changed = replace(policy, allowed_domains=("*.CDN.test",))
    assert changed.allows_domain("www.cdn.test") and not changed.allows_domain("cdn.test")
