"""A batch's statuses (OpenAI's Batch API's), the ones it ends in, and the timestamp each sets."""

from __future__ import annotations

STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling",
            "cancelled", "expired")
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
# The timestamp field each status sets when a batch moves there.
STATUS_TIMESTAMPS = {status: f"{status}_at" for status in STATUSES if status != "validating"}
