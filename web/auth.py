"""API keys: ``Authorization: Bearer <key>``. Each job belongs to the key that made it."""

from __future__ import annotations

import hashlib
import hmac

from flask import g, request

from engine.errors import UnauthorizedError

OPEN_OWNER = "local"


def key_id(key: str) -> str:
    """A stable, non-secret id for a key: what job records store as their owner."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:16]


class KeyRing:
    def __init__(self, keys: tuple[str, ...]):
        self._keys = tuple(k.encode() for k in keys)

    @property
    def open(self) -> bool:
        return not self._keys

    def authenticate(self) -> str:
        """The caller's owner id; raises UnauthorizedError for a missing or unknown key."""
        if self.open:
            return OPEN_OWNER
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UnauthorizedError("missing API key: send 'Authorization: Bearer <key>'")
        given = token.strip().encode()
        # Compare against every key in constant time, so timing does not tell which prefix matched.
        matched = [hmac.compare_digest(given, key) for key in self._keys]
        if not any(matched):
            raise UnauthorizedError("invalid API key")
        return key_id(token.strip())


def current_owner() -> str:
    return g.owner
