"""Creating a batch while its file is checked: the record first, then each block of checked lines
stored as it comes, its invalid lines as errors, its input counted against the owner's cap; the
chunks queued at the end.

Scoring starts before the end: a chunk complete while the file is still read is queued at once, and
while the batch is ``validating`` its chunk task scores its plain score lines only
(``workers/tasks/batches.py``). Those have no job, no webhook and no event: if the upload is refused
further down (too large, the key's storage full, no valid line) or the API dies under it, the batch
and what it scored are discarded (the batch reaper discards an intake that stopped writing) and
nothing of it was visible. (A chunk task that read the batch just before the discard may still
write its lines' job marks; nothing reads them, and they expire with the batch's keys.) Every other line waits for the end, when the batch moves to
``in_progress`` and the chunks not fully submitted are queued. A batch cannot end while its intake
is open (``BatchStore.close_intake``).

The API parses and checks the upload (``web.api.batches``) and feeds a :class:`BatchIntake`;
:func:`create_batch` does the same for lines checked beforehand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from domain.batches.messages import schedule_expiry, send_chunks
from domain.batches.progress import finish
from domain.batches.store import public_batch
from domain.infra.redis_client import REDIS_DOWN
from domain.infra.replication import confirm_if_asked
from engine.errors import PayloadTooLargeError, RateLimitedError

log = logging.getLogger(__name__)

# Line errors shown in the batch object (all of them are in the errors download).
REPORTED_LINE_ERRORS = 10
# A hint only: batches end when their lines do, minutes to hours.
STORAGE_RETRY_AFTER_S = 60


class BatchTooLargeError(PayloadTooLargeError):
    code = "batch_too_large"


class BatchStorageFullError(RateLimitedError):
    """The key's unfinished batches hold as much input in Redis as it may store."""

    code = "batch_storage_full"


@dataclass
class ParsedBatch:
    """Checked lines: the whole file, or one block of it."""

    valid: list[str] = field(default_factory=list)  # JSON {line, custom_id, request}, ready to store
    invalid: list[dict[str, Any]] = field(default_factory=list)  # error entries
    total: int = 0
    scoring: list[bool] = field(default_factory=list)  # per valid line: a score request


class BatchIntake:
    """A batch made from its checked lines, a block at a time. Use it as a context manager: an
    exception before :meth:`close` has moved the batch to ``in_progress`` discards it.

    ``rt``: the API's services or a worker runtime (``redis``, ``settings``, ``celery``, ``batches``).
    ``source``: how the batch was made, kept in its record (OpenAI's batches: ``api``, ``endpoint``,
    ``input_file_id``)."""

    def __init__(self, rt, owner: str, *, total: int, completion_window: int, metadata: dict | None,
                 webhook: dict | None, source: dict[str, str] | None = None):
        self.rt = rt
        self.store = rt.batches
        self.completion_window = completion_window
        self.cap = rt.settings.batch_max_stored_bytes_per_key
        self.batch = self.store.create(owner=owner, total=total, chunk_size=rt.settings.batch_chunk_size,
                                       completion_window=completion_window, metadata=metadata,
                                       webhook=webhook, source=source)
        self.valid_lines = 0
        self.invalid_lines = 0
        self.first_errors: list[dict[str, Any]] = []
        self._size = 0  # bytes of the valid lines as stored (ASCII JSON: characters are bytes)
        self._scoring: list[bool] = []  # per valid line stored, whether it is a score request
        self._queued = 0  # chunks queued while the file is read
        # Once in_progress the batch is the caller's: its jobs may run, so a later fault (a chunk
        # message not sent) leaves it to the batch reaper instead of discarding it.
        self._committed = False

    @property
    def batch_id(self) -> str:
        return self.batch["id"]

    def __enter__(self) -> BatchIntake:
        return self

    def __exit__(self, kind, _error, _traceback) -> None:
        if kind is None or self._committed:
            return
        try:
            self.store.discard(self.batch)
        except REDIS_DOWN:  # the reaper discards it once its intake is stale
            log.warning("batch %s: could not discard the refused upload now", self.batch_id)

    def add(self, block: ParsedBatch) -> None:
        """Store a block of checked lines; queue the chunks it completes that hold score lines."""
        store, batch_id = self.store, self.batch_id
        if block.valid:
            self._size += sum(len(line) for line in block.valid)
            if self._size > self.cap:
                raise BatchTooLargeError(f"the valid lines take more than {self.cap} bytes as stored, "
                                         f"the most a key may store")
            if (held := self.store.reserve_input(self.batch, self._size, cap=self.cap)) is not None:
                raise BatchStorageFullError(
                    f"this key's unfinished batches hold {held} bytes of input; this one needs {self._size} more "
                    f"and a key may store {self.cap}: retry when one ends",
                    headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)})
        store.record(batch_id, [(entry["line"], False, entry) for entry in block.invalid])
        self.invalid_lines += len(block.invalid)
        self.first_errors += block.invalid[:REPORTED_LINE_ERRORS - len(self.first_errors)]
        store.intake_progress(batch_id, invalid_lines=self.invalid_lines, validation_errors=self.first_errors)
        if not block.valid:
            return
        store.add_lines(batch_id, block.valid)
        self.valid_lines += len(block.valid)
        self._scoring += block.scoring
        chunk_size = self.batch["chunk_size"]
        complete = self.valid_lines // chunk_size
        send_chunks(self.rt.celery, batch_id, [
            index for index in range(self._queued, complete)
            if any(self._scoring[index * chunk_size:(index + 1) * chunk_size])])
        self._queued = complete

    def close(self) -> dict[str, Any]:
        """The file is read: start the batch's other work; the public batch object."""
        store, batch_id = self.store, self.batch_id
        store.move(batch_id, "in_progress", from_=("validating",))
        self._committed = True
        if store.close_intake(batch_id):  # every line already counted: invalid ones and scored ones
            finish(self.rt, batch_id)
        submitted, _ = store.chunk_progress(batch_id)
        chunks = -(-self.valid_lines // self.batch["chunk_size"])
        send_chunks(self.rt.celery, batch_id, [index for index in range(chunks) if index not in submitted])
        schedule_expiry(self.rt.celery, self.rt.settings, batch_id, self.completion_window)
        confirm_if_asked(self.rt, batch_id)
        return public_batch(store.get(batch_id))


def create_batch(rt, owner: str, parsed: ParsedBatch, *, completion_window: int,
                 metadata: dict | None, webhook: dict | None, source: dict[str, str] | None = None) -> dict[str, Any]:
    """Store the batch and its checked lines (at least one valid), then queue its chunks; the public
    batch object."""
    with BatchIntake(rt, owner, total=parsed.total, completion_window=completion_window, metadata=metadata,
                     webhook=webhook, source=source) as intake:
        intake.add(parsed)
        return intake.close()
