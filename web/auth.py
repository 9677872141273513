"""API keys: ``Authorization: Bearer <key>``, read by ``web/bearer.py`` (the event loop reads it
the same way). Each job belongs to the key that made it.

Admin keys (``ROLLOUT_ADMIN_KEYS``) are API keys that may also update weights and pause
generation. With no keys of either kind (the open demo) everyone may; with API keys but no admin
keys, nobody may.
"""

from __future__ import annotations

import hashlib
import hmac

from flask import g, request

from engine.errors import ForbiddenError, UnauthorizedError
from web.bearer import bearer_token, is_b64token

OPEN_OWNER = "local"


def key_id(key: str) -> str:
    """A stable, non-secret id for a key: what job records store as their owner."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:16]


class KeyRing:
    def __init__(self, keys: tuple[str, ...], admin_keys: tuple[str, ...] = ()):
        if not all(map(is_b64token, keys + admin_keys)):
            # A key no request can present (RFC 6750's b64token) is a mistake at start, not a 401 later.
            raise ValueError("ROLLOUT_API_KEYS and ROLLOUT_ADMIN_KEYS: each key is letters, digits and "
                             "-._~+/ with '=' only at its end (RFC 6750 b64token)")
        self._admin = tuple(k.encode() for k in admin_keys)
        self._keys = tuple(k.encode() for k in keys) + self._admin

    @property
    def open(self) -> bool:
        return not self._keys

    def authenticate(self) -> str:
        """The caller's owner id; raises UnauthorizedError for a missing or unknown key. Sets
        ``g.admin``: whether the caller may update weights."""
        g.admin = self.open
        if self.open:
            return OPEN_OWNER
        header = request.headers.get("Authorization")
        token = bearer_token(header)
        if token is None:
            if header is None or not header.lower().startswith("bearer"):
                raise UnauthorizedError("missing API key: send 'Authorization: Bearer <key>'")
            raise UnauthorizedError("invalid API key: 'Bearer', one or more spaces, then the key exactly")
        given = token.encode()
        # Compare against every key in constant time, so timing does not tell which prefix matched.
        matched = [hmac.compare_digest(given, key) for key in self._keys]
        if not any(matched):
            raise UnauthorizedError("invalid API key")
        g.admin = any(hmac.compare_digest(given, key) for key in self._admin)
        return key_id(token)


def current_owner() -> str:
    return g.owner


def require_admin() -> None:
    """Raise ForbiddenError unless the caller's key is an admin key."""
    if not g.get("admin"):
        raise ForbiddenError("this call needs an admin key (ROLLOUT_ADMIN_KEYS)")
