"""Creating a batch from its checked lines: store the record, its invalid lines as errors and its
valid lines, count the input against the owner's cap, then queue its chunks. The API parses and
checks the upload (``web.batches``) and calls :func:`create_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import PayloadTooLargeError, RateLimitedError
from workers.batches.messages import start_batch
from workers.batches.store import public_batch
from workers.infra.replication import confirm_if_asked

# Line errors shown in the batch object (all of them are in the errors download).
REPORTED_LINE_ERRORS = 10
RECORD_PAGE = 1000
# A hint only: batches end when their lines do, minutes to hours.
STORAGE_RETRY_AFTER_S = 60


class BatchTooLargeError(PayloadTooLargeError):
    code = "batch_too_large"


class BatchStorageFullError(RateLimitedError):
    """The key's unfinished batches hold as much input in Redis as it may store."""

    code = "batch_storage_full"


@dataclass
class ParsedBatch:
    valid: list[str] = field(default_factory=list)  # JSON {line, custom_id, request}, ready to store
    invalid: list[dict[str, Any]] = field(default_factory=list)  # error entries
    total: int = 0


def create_batch(rt, owner: str, parsed: ParsedBatch, *, completion_window: int,
                 metadata: dict | None, webhook: dict | None, source: dict[str, str] | None = None) -> dict[str, Any]:
    """Store the batch and its lines, then queue its chunks; the public batch object. ``rt``: the
    API's services or a worker runtime (``redis``, ``settings``, ``celery``). ``source``: how the
    batch was made, kept in its record (OpenAI's batches: ``api``, ``endpoint``, ``input_file_id``)."""
    store = rt.batches
    cap = rt.settings.batch_max_stored_bytes_per_key
    size = sum(len(line) for line in parsed.valid)  # ASCII JSON: characters are bytes
    if size > cap:
        raise BatchTooLargeError(f"the valid lines take {size} bytes as stored; a key may store at most {cap}")
    batch = store.create(owner=owner, total=parsed.total, chunk_size=rt.settings.batch_chunk_size,
                         completion_window=completion_window, metadata=metadata, webhook=webhook,
                         validation_errors=parsed.invalid[:REPORTED_LINE_ERRORS],
                         invalid_lines=len(parsed.invalid), source=source)
    batch_id = batch["id"]
    held = store.reserve_input(batch, size, cap=cap)
    if held is not None:
        store.discard(batch)
        raise BatchStorageFullError(
            f"this key's unfinished batches hold {held} bytes of input; this one needs {size} more "
            f"and a key may store {cap}: retry when one ends", headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)})
    for start in range(0, len(parsed.invalid), RECORD_PAGE):
        store.record(batch_id, [(entry["line"], False, entry) for entry in parsed.invalid[start:start + RECORD_PAGE]])
    chunks = store.add_lines(batch_id, parsed.valid)
    store.move(batch_id, "in_progress", from_=("validating",))
    start_batch(rt.celery, rt.settings, batch_id, chunks, completion_window)
    confirm_if_asked(rt, batch_id)
    return public_batch(store.get(batch_id))
