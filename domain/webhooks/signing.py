"""Standard Webhooks signatures (the ``standardwebhooks`` library) for one attempt's headers."""

from __future__ import annotations

from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook


class Signer:
    """Standard Webhooks headers for one attempt, signed with every configured secret.

    Several secrets (a rotation in progress) give several space-separated signatures; a receiver
    that knows any one of them verifies. With no secret the headers carry no signature.
    """

    def __init__(self, secrets_: tuple[str, ...]):
        self._webhooks = tuple(Webhook(secret) for secret in secrets_)

    @property
    def signs(self) -> bool:
        return bool(self._webhooks)

    def headers(self, msg_id: str, timestamp: int, payload: str) -> dict[str, str]:
        # The library signs floor(timestamp.replace(tzinfo=utc)): a naive local or non-UTC aware
        # datetime would silently sign another second, so build an aware UTC one here. The payload
        # must be the str: bytes would be signed as "b'...'".
        when = datetime.fromtimestamp(timestamp, tz=UTC)
        headers = {"webhook-id": msg_id, "webhook-timestamp": str(timestamp)}
        if self._webhooks:
            headers["webhook-signature"] = " ".join(w.sign(msg_id, when, payload) for w in self._webhooks)
        return headers
