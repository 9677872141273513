"""The guarded fetcher: GET media by URL, POST webhooks, both only where the policy allows."""

from __future__ import annotations

import time
from urllib.parse import urljoin

from .data_urls import read_data_url
from .deadline import Deadline
from .errors import MediaBlockedError, MediaError, MediaFetchError, MediaRejectedError
from .files import read_file_url
from .guard import HTTP_SCHEMES, pin_http_target
from .media import FetchedMedia, OutboundResponse
from .policy import FetchPolicy
from .resolver import Resolver, system_resolver
from .transport import open_pool, read_body, send
from .urls import ParsedURL, check_raw, parse

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# First pause before a retry; it doubles per attempt and never outlasts the total deadline.
RETRY_BACKOFF_S = 0.1
# A webhook receiver's answer is only logged: keep a little of it, not max_bytes.
POST_RESPONSE_CAP = 64 * 1024
GET_HEADERS = {"Accept": "*/*", "Accept-Encoding": "gzip, deflate"}


class GuardedFetcher:
    """Fetches http(s), data: and file: media under a :class:`FetchPolicy`.

    ``resolver(host, port)`` returns the addresses of ``host``; the default asks the system
    resolver. It is called once per hop and the connection goes to a checked answer, so a
    resolver that changes its answers (DNS rebinding) cannot steer the connection.
    """

    def __init__(self, policy: FetchPolicy, resolver: Resolver | None = None):
        self.policy = policy
        self._resolver = resolver or system_resolver

    def deadline(self) -> Deadline:
        """A fresh budget of ``policy.total_timeout`` for several fetches to share (all media of
        one job); enter it to start the clock, and pass it to each :meth:`fetch`."""
        return Deadline(self.policy.total_timeout)

    def fetch(self, url: str, *, deadline: Deadline | None = None) -> FetchedMedia:
        """GET ``url``. Within ``deadline`` (started, owned by the caller) when given, else within
        a budget of its own of ``policy.total_timeout``."""
        parsed = parse(url)  # every refusal of the URL itself happens here, before any I/O
        if parsed.scheme == "data":
            return read_data_url(parsed.raw, self.policy.max_data_url_bytes or self.policy.max_bytes)
        if parsed.scheme == "file":
            return read_file_url(parsed, self.policy)
        if parsed.scheme not in HTTP_SCHEMES:
            raise MediaBlockedError(f"the URL scheme {parsed.scheme!r} is not allowed", reason="scheme")
        if deadline is not None:
            return self._get_with_retries(parsed, deadline)
        with self.deadline() as own:
            return self._get_with_retries(parsed, own)

    def _get_with_retries(self, parsed: ParsedURL, deadline: Deadline) -> FetchedMedia:
        attempt = 0
        while True:
            try:
                return self._get(parsed, deadline)
            except MediaError as exc:
                if not exc.retryable or attempt >= self.policy.retries:
                    raise
                pause = RETRY_BACKOFF_S * 2**attempt
                if deadline.expired or pause >= deadline.remaining():
                    raise
                time.sleep(pause)
                attempt += 1

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> OutboundResponse:
        """POST once; any status, 3xx included, comes back as a response and is not followed."""
        parsed = parse(url)
        started = time.monotonic()
        with Deadline(self.policy.total_timeout) as deadline:
            target = pin_http_target(parsed, self.policy, self._resolver, deadline)
            with open_pool(target, self.policy, deadline) as pool:
                resp = send(pool, target, "POST", headers, body, deadline)
                try:
                    data = read_body(resp, POST_RESPONSE_CAP, deadline, truncate=True)
                finally:
                    resp.close()
        return OutboundResponse(resp.status, dict(resp.headers), data, time.monotonic() - started)

    def _get(self, url: ParsedURL, deadline: Deadline) -> FetchedMedia:
        """One attempt: follow redirects ourselves, every hop checked like the first."""
        for _hop in range(self.policy.max_redirects + 1):
            target = pin_http_target(url, self.policy, self._resolver, deadline)
            with open_pool(target, self.policy, deadline) as pool:
                resp = send(pool, target, "GET", GET_HEADERS, None, deadline)
                try:
                    if resp.status in REDIRECT_STATUSES:
                        url = self._next_hop(url, resp.headers.get("Location"))
                        continue
                    if resp.status >= 500:
                        raise MediaFetchError(f"the media host answered {resp.status}", status=resp.status)
                    if not 200 <= resp.status < 300:
                        raise MediaRejectedError(f"the media host answered {resp.status}", status=resp.status)
                    data = read_body(resp, self.policy.max_bytes, deadline)
                    return FetchedMedia(data, resp.headers.get("Content-Type"), url.url)
                finally:
                    resp.close()
        raise MediaBlockedError(
            f"the media URL redirects more than {self.policy.max_redirects} times", reason="redirect"
        )

    @staticmethod
    def _next_hop(current: ParsedURL, location: str | None) -> ParsedURL:
        if not location:
            raise MediaBlockedError("the media host redirected without a Location", reason="redirect")
        # The raw checks run on the Location as sent; urljoin only makes a relative reference
        # absolute, and the joined URL is then parsed by the same parser as any other.
        nxt = parse(urljoin(current.url, check_raw(location)))
        if nxt.scheme != current.scheme:
            raise MediaBlockedError("the media URL redirects to another scheme", reason="scheme")
        return nxt
