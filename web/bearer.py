"""The one reading of a request's API key: ``Authorization: Bearer <key>``.

The app authenticates with it (``web/auth.py``) and the event loop shares threads by it
(``web/serving/thread_share.py``), so a request has one identity in both. They once read it two
ways (``bytes.strip`` in the loop, ``str.strip`` in the app), and a key padded with U+00A0 or U+0085
logged in as itself yet counted as a new key to the loop, with a thread share of its own.

The grammar is RFC 6750 section 2.1, exactly: ``"Bearer" 1*SP b64token``, the scheme in any case
(RFC 7235 section 2.1). The header's own surrounding spaces and tabs are not part of its value
(RFC 9110 section 5.5: gunicorn drops them for both readers); anything else, inside or around the
token, is not a key and is refused, never trimmed.
"""

from __future__ import annotations

import re

# re.ASCII: the scheme's case-folding stays in ASCII (no Unicode letter folds into "bearer").
_BEARER = re.compile(r"bearer +([A-Za-z0-9\-._~+/]+=*)", re.IGNORECASE | re.ASCII)
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*", re.ASCII)


def bearer_token(authorization: str | None) -> str | None:
    """The key an ``Authorization`` value presents, or None: no header, another scheme, or a value
    that is not exactly ``Bearer`` and a b64token. Repeated headers come joined by commas (as
    gunicorn hands them to the app), which no key holds: None."""
    if authorization is None:
        return None
    match = _BEARER.fullmatch(authorization)
    return match.group(1) if match else None


def is_b64token(key: str) -> bool:
    """Whether ``key`` can be presented at all: the configured keys are checked with this."""
    return _B64TOKEN.fullmatch(key) is not None
