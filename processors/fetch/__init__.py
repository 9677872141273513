"""Guarded media fetching and decoding.

``GuardedFetcher(policy).fetch(url)`` gets the bytes behind an http(s), data: or file: URL only
where the :class:`FetchPolicy` allows (scheme, domain, port, every resolved address, media
root, size and time caps), following redirects itself so every hop is checked; ``post()`` sends
webhooks under the same address rules. ``decode_image``/``decode_video``/``decode_audio`` turn
the bytes into pixels, frames or samples under their own caps.

Errors (all :class:`engine.errors.MediaError`; see ``processors.fetch.errors``):

    MediaBlockedError · MediaTooLargeError · MediaTimeoutError
    MediaFetchError └ MediaRejectedError · MediaDecodeError
"""

from .audio import decode_audio
from .errors import (
    MediaBlockedError,
    MediaDecodeError,
    MediaFetchError,
    MediaRejectedError,
    MediaTimeoutError,
    MediaTooLargeError,
)
from .fetcher import GuardedFetcher
from .images import IMAGE_FORMATS, decode_image
from .media import FetchedMedia, OutboundResponse
from .policy import FetchPolicy, log_policy_warnings
from .resolver import Resolver, system_resolver
from .video import VIDEO_FORMATS, decode_video

__all__ = [
    "IMAGE_FORMATS",
    "VIDEO_FORMATS",
    "FetchPolicy",
    "FetchedMedia",
    "GuardedFetcher",
    "MediaBlockedError",
    "MediaDecodeError",
    "MediaFetchError",
    "MediaRejectedError",
    "MediaTimeoutError",
    "MediaTooLargeError",
    "OutboundResponse",
    "Resolver",
    "decode_audio",
    "decode_image",
    "decode_video",
    "log_policy_warnings",
    "system_resolver",
]
