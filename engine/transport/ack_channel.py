"""How a consumer's acknowledgements reach the producer's pool: a protocol the engine defines.

The engine knows no broker: the domain implements this (with Redis lists:
``domain/infra/transport_acks.py``) and the worker hands an instance to ``make_transport`` and
to ``acknowledge``/``opened``. Any process of the node that can reach the same channel can
acknowledge any pool's features.

A lost ack only delays reuse until the pool's ``ack_timeout`` reclaims the region, so a channel
never raises for an outage: it logs and says it failed (False, None), and the pool goes on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class AckChannel(Protocol):
    """The three operations the feature transport needs of its acknowledgement channel."""

    def send(self, acks: Mapping[str, Sequence[str]]) -> bool:
        """Post feature ids per pool id (consumers), as one round trip where the medium allows.
        False when the medium failed (logged); nothing is retried."""

    def drain(self, pool_id: str) -> list[str] | None:
        """Take every id posted for a pool so far, oldest first (the producer's pool); each id is
        taken once. None when the medium failed (logged)."""

    def discard(self, pool_id: str) -> None:
        """Drop whatever is still posted for a pool (its close); a failure is logged, not raised."""
