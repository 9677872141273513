"""What the Redis stores (jobs, batches, webhook events) share: field encoding of a record hash,
decoding it back, and paging a newest-first index or a list.

A record is a Redis hash of text fields. By field name: JSON fields hold compact JSON, fields
ending in ``_at`` hold Unix seconds (empty for none), integer fields hold decimal text, the rest
is plain text (empty for None). Only store modules call these.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

import orjson
import redis

from domain.infra import finite_json

Record = TypeVar("Record")


def new_id(prefix: str) -> str:
    """A new id for a job, batch, file or render: 128 random bits, so ids are unguessable, and a
    guess is answered like a stranger's object (404)."""
    return f"{prefix}_{secrets.token_urlsafe(16)}"


def plausible_id(object_id: str) -> bool:
    """Whether ``object_id`` could be one of our ids; anything else is never looked up (no key is
    built from it)."""
    return 0 < len(object_id) <= 64 and all(c.isalnum() or c in "-_" for c in object_id)


class StoredJSON:
    """A JSON field as stored (its compact JSON bytes, as ``encode_field`` wrote them), for a reader
    that passes it on without reading it: a stream sends a job's result as stored, where its
    decoded objects would take about five times its bytes. Weak references let readers of one
    record share one copy."""

    __slots__ = ("data", "__weakref__")

    def __init__(self, data: bytes):
        self.data = data


def encode_field(name: str, value: Any, json_fields: Collection[str]) -> str:
    if name in json_fields:
        return finite_json.compact(value)
    return "" if value is None else str(value)


def decode_record(raw: dict[bytes, bytes] | dict[str, str], *, json_fields: Collection[str] = (),
                  int_fields: Collection[str] = (), own_json_fields: Collection[str] = (),
                  stored_fields: Collection[str] = ()) -> dict[str, Any]:
    """A record hash as read (bytes) or as just encoded (str), decoded by field name.
    ``own_json_fields``: JSON fields only the service fills, with no number a user sent, read with
    orjson (a job's result: 2.5 against 17 µs). orjson reads an integer past 64 bits as a float, so
    a field that may hold a user's value (a request, metadata, an error naming a bad value) stays with ``json``.
    ``stored_fields``: JSON fields left as stored, each a :class:`StoredJSON` (None when empty)."""
    record: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else key
        if name in stored_fields:
            record[name] = StoredJSON(value.encode() if isinstance(value, str) else value) if value else None
            continue
        if name in own_json_fields:
            record[name] = orjson.loads(value) if value else None
            continue
        text = value.decode() if isinstance(value, bytes) else value
        if name in json_fields:
            record[name] = json.loads(text) if text else None
        elif name in int_fields:
            record[name] = int(text)
        elif name.endswith("_at"):
            record[name] = float(text) if text else None
        else:
            record[name] = text
    return record


def page_by_creation(client: redis.Redis, index: str, *, limit: int, cursor: str | None,
                     load: Callable[[list[str]], list[Record | None]], keep: Callable[[Record], bool],
                     newest_first: bool = True, filtered: bool = True) -> tuple[list[Record], str | None]:
    """Up to ``limit`` records of the sorted set ``index`` (member -> creation time), newest first
    (or oldest first), that ``keep`` accepts; and the cursor of the next page (None at the end).

    ``load`` reads the records of some members (None for an expired one, which is dropped from the
    index as we pass). The cursor is the score of the last record returned. ``filtered=False``
    says ``keep`` takes every record: then no more records are read than the page returns (a
    job's record holds its result, up to tens of MB: ``limit=1`` must read one).
    """
    bound = f"({cursor}" if cursor else ("+inf" if newest_first else "-inf")
    found: list[Record] = []
    while len(found) < limit:
        page = max(limit * 2, 50) if filtered else limit - len(found)
        if newest_first:
            scored = client.zrevrangebyscore(index, bound, "-inf", start=0, num=page, withscores=True)
        else:
            scored = client.zrangebyscore(index, bound, "+inf", start=0, num=page, withscores=True)
        if not scored:
            break
        records = load([member.decode() for member, _ in scored])
        for (member, score), record in zip(scored, records, strict=True):
            bound = f"({score!r}"
            if record is None:
                client.zrem(index, member)
                continue
            if keep(record):
                found.append(record)
                if len(found) == limit:
                    return found, repr(score)
    return found, None


def iter_list(client: redis.Redis, key: str, page: int) -> Iterator[list[bytes]]:
    """A list's items, ``page`` at a time, as stored. A list that only grows meanwhile is read
    without skipping or repeating an item."""
    start = 0
    while items := client.lrange(key, start, start + page - 1):
        yield items
        start += len(items)
