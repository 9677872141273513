"""When to send a request again, and after how long.

429 (too many unfinished jobs) and 503 (the service or its store is briefly down) are retried with
exponential backoff; a ``Retry-After`` from the server (seconds or an HTTP date) replaces the
computed delay, up to ``max_delay``. Connection failures and timeouts are retried only for requests
that are safe to send twice: reads, cancels, and submits, which carry an ``Idempotency-Key`` of
their own so the service makes their jobs once however often they arrive (README, API). A batch
upload is not resent.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 5
    backoff: float = 0.5  # the first delay; doubled each retry
    max_delay: float = 60.0
    statuses: tuple[int, ...] = (429, 503)
    jitter: float = 0.1  # +-10%, so many clients told the same thing do not come back at once

    def delay(self, retry: int, retry_after: str | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        told = parse_retry_after(retry_after)
        if told is not None:
            return min(told, self.max_delay)
        computed = min(self.backoff * 2 ** (retry - 1), self.max_delay)
        return computed * random.uniform(1 - self.jitter, 1 + self.jitter)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or an HTTP date); None if absent
    or unreadable. Shared with the service's webhook retries."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # HTTP dates are GMT
        when = when.replace(tzinfo=UTC)
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)
