"""The media errors: what can go wrong between a URL and decoded pixels, frames or samples.

    engine.errors.MediaError                     code                 retryable
    ├── MediaBlockedError                        media_blocked        no   (policy refused; .reason)
    ├── MediaTooLargeError                       media_too_large      no
    ├── MediaTimeoutError                        media_timeout        yes
    ├── MediaFetchError                          media_fetch_failed   yes  (connection, DNS, 5xx)
    │   └── MediaRejectedError                   media_rejected       no   (upstream 4xx, TLS verify)
    └── MediaDecodeError                         media_decode_failed  no

All answer 422: the media a request points at is unusable (a too-large download is not a
too-large request body, so it is not a 413). Messages name the rule that refused, never a
resolved address: a client must not learn what an internal host name resolves to.
"""

from __future__ import annotations

from typing import Literal

from engine.errors import Fault, MediaError

BlockReason = Literal[
    "scheme",  # not http/https/data/file, or a redirect that changes scheme
    "url",  # unparsable, userinfo, backslash, control characters, surrounding blanks
    "host",  # host name that is not a valid IDNA (UTS 46, STD3) name
    "domain",  # host outside allowed_domains
    "port",  # port outside allowed_ports
    "address",  # resolves to a refused address (loopback, private, link-local, ...)
    "file_path",  # file: URL outside media_root, or not a regular file, or no media_root
    "data_url",  # data: URL that is not base64
    "redirect",  # too many redirects, or a redirect without a usable Location
]


class MediaBlockedError(MediaError):
    """The fetch policy refused the URL (or a redirect hop) before any I/O to it."""

    code = "media_blocked"

    def __init__(self, message: str, *, reason: BlockReason):
        super().__init__(message, errors={"reason": reason})
        self.reason: BlockReason = reason


class MediaTooLargeError(MediaError):
    """A byte, pixel, frame or duration cap was exceeded."""

    code = "media_too_large"


class MediaTimeoutError(MediaError):
    """The connect deadline or the total deadline of the fetch passed."""

    code = "media_timeout"
    retryable = True


class MediaFetchError(MediaError):
    """The upstream could not be reached or answered with a server error."""

    code = "media_fetch_failed"
    retryable = True

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message, errors={"status": status} if status is not None else None)
        self.status = status


class MediaRejectedError(MediaFetchError):
    """The upstream refused (4xx) or its TLS certificate did not verify: retrying will not help."""

    code = "media_rejected"
    retryable = False


class MediaTooShortError(MediaError):
    """The item decodes, but is too short for the model's encoder to make any feature of it (audio
    of a few milliseconds)."""

    code = "media_too_short"
    fault = Fault.INVALID


class MediaDecodeError(MediaError):
    """The bytes are not a readable image, video or audio file of an allowed format."""

    code = "media_decode_failed"
