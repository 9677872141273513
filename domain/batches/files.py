"""Files in Redis, for ``/v1/files`` (OpenAI's Files API, purpose ``batch``).

Two kinds of file share one record shape and one listing:

- uploaded files: the bytes are stored here, counted against the owner's input cap
  (``domain.batches.stored_input``) until deleted or expired (``result_ttl`` after the upload);
- a batch's results (purpose ``batch_output``): made when the batch ends, they hold no bytes of
  their own but name the batch and its result list (``output`` or ``errors``); the API renders
  them on download, so results are never stored twice.

    rq:file:<id>         hash: id, owner, purpose, filename, bytes, created_at, expires_at, and for
                         results batch_id and results
    rq:file:<id>:data    string: an uploaded file's bytes
    rq:files:<owner>     sorted set: the owner's file ids by creation time (listing)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import IO, Any

import redis

from domain.batches.keys import (
    data_key,
    file_key,
    owner_files_key,
)
from domain.batches.stored_input import StoredInput
from domain.infra.redis_records import decode_record, encode_field, new_id, page_by_creation, plausible_id
from engine.errors import NotFoundError, PayloadTooLargeError, RateLimitedError

PURPOSES = ("batch", "batch_output")
RESULTS = ("output", "errors")
CHUNK = 1024 * 1024
_INT_FIELDS = ("bytes",)
# A hint only: input is freed when batches end or files are deleted.
STORAGE_RETRY_AFTER_S = 60


class FileTooLargeError(PayloadTooLargeError):
    """One file larger than all a key may store (ROLLOUT_BATCH_MAX_STORED_BYTES_PER_KEY)."""

    code = "file_too_large"


class FileStorageFullError(RateLimitedError):
    """The key's files and unfinished batches hold as much input as it may store."""

    code = "file_storage_full"





class FileStore:
    def __init__(self, client: redis.Redis, *, ttl: int):
        self.redis = client
        self.ttl = ttl
        self._input = StoredInput(client)

    def upload(self, *, owner: str, filename: str, purpose: str, stream: IO[bytes], size: int,
               cap: int) -> dict[str, Any]:
        """Store ``size`` bytes read from ``stream`` (a chunk at a time) as a new file of ``owner``."""
        if size > cap:  # can never fit, whatever else is deleted: not a retry (429) but a 413, as batches
            raise FileTooLargeError(f"the file takes {size} bytes; a key may store at most {cap}")
        file_id = new_id("file")
        held = self._input.reserve(owner, file_id, size, cap=cap, ttl=self.ttl)
        if held is not None:
            raise FileStorageFullError(
                f"this key's files and unfinished batches hold {held} bytes; this file needs {size} more "
                f"and a key may store {cap}: delete files or retry when a batch ends",
                headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)})
        now = time.time()
        expires_at = int(now + self.ttl)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(data_key(file_id), b"")
            while chunk := stream.read(CHUNK):
                pipe.append(data_key(file_id), chunk)
            pipe.expireat(data_key(file_id), expires_at)
            pipe.execute()
        except BaseException:
            self.redis.delete(data_key(file_id))
            self._input.forget(owner, file_id)
            raise
        return self._add(file_id, owner=owner, purpose=purpose, filename=filename, size=size, now=now,
                         expires_at=expires_at)

    def add_results(self, batch: dict[str, Any], results: str, *, file_id: str, expires_at: int) -> dict[str, Any]:
        """A file that is the batch's ``results`` (``output`` or ``errors``), rendered on download."""
        return self._add(file_id, owner=batch["owner"], purpose="batch_output",
                         filename=f"{batch['id']}_{results}.jsonl", size=None, now=time.time(),
                         expires_at=expires_at, batch_id=batch["id"], results=results)

    def _add(self, file_id: str, *, owner: str, purpose: str, filename: str, size: int | None, now: float,
             expires_at: int, **extra: str) -> dict[str, Any]:
        fields = {"id": file_id, "owner": owner, "purpose": purpose, "filename": filename, "bytes": size,
                  "created_at": now, "expires_at": expires_at, **extra}
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(file_key(file_id), mapping={k: encode_field(k, v, ()) for k, v in fields.items() if v is not None})
        pipe.expireat(file_key(file_id), expires_at)
        pipe.zadd(owner_files_key(owner), {file_id: now})
        # Every file lives at most ``ttl`` from its creation, so the newest one's sets the index's.
        pipe.expireat(owner_files_key(owner), max(expires_at, int(now) + self.ttl))
        pipe.execute()
        return self.get(file_id)

    def set_size(self, file_id: str, size: int) -> None:
        """Record the size of a results file once it is known (the first time it is rendered)."""
        self.redis.hset(file_key(file_id), "bytes", size)

    # --- Reading --------------------------------------------------------------------------------

    def get(self, file_id: str, *, owner: str | None = None) -> dict[str, Any]:
        """The file's record, or NotFoundError — also when it belongs to another owner."""
        raw = self.redis.hgetall(file_key(file_id)) if plausible_id(file_id) else {}
        if not raw or (owner is not None and raw.get(b"owner", b"").decode() != owner):
            raise NotFoundError(f"no file {file_id!r}")
        return decode_record(raw, int_fields=_INT_FIELDS)

    def list(self, *, owner: str, purpose: str | None, limit: int, cursor: str | None,
             newest_first: bool = True) -> tuple[list[dict[str, Any]], str | None]:
        """The owner's files, newest first unless asked; the cursor is the creation time of the last one seen."""
        return page_by_creation(self.redis, owner_files_key(owner), limit=limit, cursor=cursor, load=self._get_many,
                                keep=lambda f: purpose is None or f["purpose"] == purpose, newest_first=newest_first)

    def _get_many(self, file_ids: list[str]) -> list[dict[str, Any] | None]:
        pipe = self.redis.pipeline(transaction=False)
        for file_id in file_ids:
            pipe.hgetall(file_key(file_id))
        return [decode_record(raw, int_fields=_INT_FIELDS) if raw else None for raw in pipe.execute()]

    def read(self, file_id: str) -> bytes:
        """An uploaded file's bytes (NotFoundError once they expired)."""
        data = self.redis.get(data_key(file_id))
        if data is None:
            raise NotFoundError(f"no file {file_id!r}")
        return data

    def has_data(self, file_id: str) -> bool:
        return bool(self.redis.exists(data_key(file_id)))

    def iter_chunks(self, file_id: str, size: int) -> Iterator[bytes]:
        """An uploaded file's bytes, ``CHUNK`` at a time (a download never holds the whole file)."""
        for start in range(0, size, CHUNK):
            yield self.redis.getrange(data_key(file_id), start, min(start + CHUNK, size) - 1)

    # --- Deleting -------------------------------------------------------------------------------

    def delete(self, record: dict[str, Any]) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(file_key(record["id"]), data_key(record["id"]))
        pipe.zrem(owner_files_key(record["owner"]), record["id"])
        self._input.forget(record["owner"], record["id"], pipe)
        pipe.execute()
