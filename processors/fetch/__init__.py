"""Guarded media fetching and decoding.

``GuardedFetcher(policy).fetch(url)`` gets the bytes behind an http(s), data: or file: URL only
where the :class:`FetchPolicy` allows (scheme, domain, port, every resolved address, media
root, size and time caps), following redirects itself so every hop is checked; ``post()`` sends
webhooks under the same address rules. Decoding the bytes is ``processors.decode``'s job.

Errors (all :class:`engine.errors.MediaError`; see ``processors.fetch.errors``):

    MediaBlockedError · MediaTooLargeError · MediaTimeoutError · MediaTooShortError
    MediaFetchError └ MediaRejectedError · MediaDecodeError
"""

from .errors import (
    MediaBlockedError,
    MediaDecodeError,
    MediaFetchError,
    MediaRejectedError,
    MediaTimeoutError,
    MediaTooLargeError,
    MediaTooShortError,
)
from .fetcher import GuardedFetcher
from .media import FetchedMedia, OutboundResponse
from .policy import FetchPolicy, log_policy_warnings
from .resolver import Resolver, system_resolver

__all__ = [
    "FetchPolicy",
    "FetchedMedia",
    "GuardedFetcher",
    "MediaBlockedError",
    "MediaDecodeError",
    "MediaFetchError",
    "MediaRejectedError",
    "MediaTimeoutError",
    "MediaTooLargeError",
    "MediaTooShortError",
    "OutboundResponse",
    "Resolver",
    "log_policy_warnings",
    "system_resolver",
]
