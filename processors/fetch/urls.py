"""Parse and normalize a media URL with the one parser that also drives the connection.

urllib3's ``parse_url`` is what urllib3 and requests use to connect, so a URL is judged the way
it will be used: no second parser that could read the host differently (the classic
"parser differential" behind many SSRF bypasses).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

import idna
from urllib3.exceptions import LocationParseError
from urllib3.util import parse_url

from .errors import MediaBlockedError

DEFAULT_PORTS = {"http": 80, "https": 443}
# Up to the end of the authority: parse_url silently drops an empty userinfo ("http://@host/"),
# so "@" is looked for in the raw authority as well.
_AUTHORITY = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)")
# Unicode category Cc exactly (C0, DEL, C1); a regex because a data: URL can be many megabytes.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_DATA_SCHEME = re.compile(r"^data:", re.IGNORECASE)


@dataclass(frozen=True)
class ParsedURL:
    scheme: str  # lower case
    # IDNA A-label in lower case without trailing dot; IP literals compressed, without brackets.
    host: str | None
    port: int | None  # the explicit port, else the scheme's default (None for data:/file:)
    target: str  # request target: path and query, percent-encoded as parse_url left it
    path: str  # path alone, still percent-encoded
    raw: str

    @property
    def is_ip_literal(self) -> bool:
        return self.host is not None and _ip_or_none(self.host) is not None

    @property
    def authority(self) -> str:
        """host[:port] as it goes into the Host header (port only when not the default)."""
        assert self.host is not None
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.port == DEFAULT_PORTS.get(self.scheme):
            return host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        if self.host is None:
            return self.raw
        return f"{self.scheme}://{self.authority}{self.target}"


def check_raw(url: object) -> str:
    """Refuse what no parser should be asked to interpret."""
    if not isinstance(url, str) or not url:
        raise MediaBlockedError("the media URL must be a non-empty string", reason="url")
    if url[0].isspace() or url[-1].isspace():
        raise MediaBlockedError("the media URL has leading or trailing blanks", reason="url")
    if "\\" in url:
        raise MediaBlockedError("the media URL contains a backslash", reason="url")
    if _CONTROL.search(url):
        raise MediaBlockedError("the media URL contains control characters", reason="url")
    return url


def parse(url: object) -> ParsedURL:
    """Check and parse a URL; the host is normalized, the scheme not yet judged."""
    if isinstance(url, str) and _DATA_SCHEME.match(url):
        # No host, port or path to judge. Only the part before the payload is scanned here: the
        # payload (megabytes) is size-capped first and then strictly base64-decoded, which
        # refuses any blank, control character or backslash in it.
        comma = url.find(",")
        check_raw(url[: comma if comma >= 0 else len(url)])
        if url[-1].isspace():
            raise MediaBlockedError("the media URL has leading or trailing blanks", reason="url")
        return ParsedURL("data", None, None, "", "", url)
    raw = check_raw(url)
    try:
        parts = parse_url(raw)
    except LocationParseError:
        raise MediaBlockedError("the media URL cannot be parsed", reason="url") from None
    if not parts.scheme:
        raise MediaBlockedError("the media URL has no scheme", reason="scheme")
    scheme = parts.scheme.lower()
    authority = _AUTHORITY.match(raw)
    if parts.auth is not None or (authority and "@" in authority.group(1)):
        raise MediaBlockedError("the media URL must not carry user information", reason="url")
    host = normalize_host(parts.host) if parts.host else None
    port = parts.port if parts.port is not None else DEFAULT_PORTS.get(scheme)
    target = parts.request_uri or "/"
    return ParsedURL(scheme, host, port, target, parts.path or "", raw)


def normalize_host(host: str) -> str:
    """IP literals in compressed form; names as lower-case IDNA A-labels without trailing dot."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if name.endswith("."):
        name = name[:-1]
    ip = _ip_or_none(name)
    if ip is not None:
        return str(ip)
    try:
        # UTS 46 maps (case, width) the way browsers do; STD3 rules refuse anything that is not
        # letter/digit/hyphen, so "%", "_" or stray punctuation never reach a resolver.
        return idna.encode(name, uts46=True, std3_rules=True).decode("ascii")
    except (idna.IDNAError, UnicodeError):
        raise MediaBlockedError("the media URL's host is not a valid host name", reason="host") from None


def _ip_or_none(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None
