"""Server-Sent Events: the wire format, the per-process stream slots, and ``/v1/jobs/{id}/events``.

How long-lived streams are served (gunicorn's gthread worker, ``web/serving/server.py``): a stream is a
WSGI response generator on a worker thread, and that thread spends its life waiting on its queue
of the process's event hub (``domain/jobs/event_hub.py``: one XREAD for every stream of the
process), which releases the GIL: an idle stream costs a parked OS thread (its stack is virtual
memory, mostly untouched) and no CPU. That is why threads and not gevent
(monkey-patching Celery's publisher, redis-py and the rest of the API process for one route) nor a
second async server (its own auth, error shapes and deployment for the same routes). What threads
need is a bound so streams never take the threads ordinary requests run on: each process has
``ROLLOUT_API_THREADS`` threads for requests plus ``ROLLOUT_API_STREAM_SLOTS`` for streams, and a
stream beyond the slots is refused with ``503 too_many_streams`` (retryable) instead of queueing
in front of ordinary requests; one key holds at most ``ROLLOUT_API_STREAM_SLOTS_PER_KEY`` of them. A
reader that stops reading is dropped once a write to it waits ``ROLLOUT_STREAM_WRITE_TIMEOUT``
(``web/serving/request_buffering.py`` sets it on the socket), and its slot comes back.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flask import Response

from domain.infra.redis_records import StoredJSON
from domain.infra.store_errors import STORE_FAILURES
from domain.jobs.events import plausible_event_id
from domain.jobs.follow import AttemptFilter, Ended, KeepAlive, follow
from domain.jobs.view import public_job
from engine.errors import InvalidRequestError, RolloutError, ServiceUnavailableError
from web.api.stored_json import stored_pieces
from web.auth import current_owner

log = logging.getLogger(__name__)

KEEPALIVE = b": keep-alive\n\n"
# A large message (a result with every token's top logprobs) is written in pieces of about this
# size: it never exists as one encoded string, and each piece meets the write timeout on its own.
PIECE_BYTES = 64 * 1024
_SLICE = 256  # list items the C encoder turns into text at once


# The stored results this process's streams are sending, by job: the streams of one job share one
# copy (an ended job's result never changes), gone with the last stream that holds it.
_SENDING: weakref.WeakValueDictionary[str, StoredJSON] = weakref.WeakValueDictionary()


class TooManyStreamsError(ServiceUnavailableError):
    code = "too_many_streams"


def sse(data: Any, *, event: str | None = None, event_id: str | None = None) -> bytes:
    """One SSE message: ``data`` as compact JSON (a str as is, e.g. ``[DONE]``)."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event is not None:
        lines.append(f"event: {event}")
    payload = data if isinstance(data, str) else _dumps(data)
    lines.append(f"data: {payload}")
    return ("\n".join(lines) + "\n\n").encode()


def sse_pieces(data: Any, *, event: str | None = None) -> Iterator[bytes]:
    """:func:`sse` of ``data`` (the same bytes), in pieces of about :data:`PIECE_BYTES`. A
    :class:`StoredJSON` in ``data`` is sent from its bytes, as :func:`sse` writes its value."""
    if isinstance(data, str):
        yield sse(data, event=event)
        return
    piece = bytearray(f"event: {event}\ndata: " if event is not None else "data: ", "utf-8")
    for part in _json_parts(data):
        piece += part if isinstance(part, bytes) else part.encode()
        if len(piece) >= PIECE_BYTES:
            yield bytes(piece)
            piece.clear()
    piece += b"\n\n"
    yield bytes(piece)


def json_pieces(data: Any) -> Iterator[bytes]:
    """``data`` as compact JSON (:func:`sse`'s spelling) in pieces of about :data:`PIECE_BYTES`: a
    :class:`StoredJSON` in it sent from its bytes (``GET /v1/jobs/{id}``'s result)."""
    piece = bytearray()
    for part in _json_parts(data):
        piece += part if isinstance(part, bytes) else part.encode()
        if len(piece) >= PIECE_BYTES:
            yield bytes(piece)
            piece.clear()
    yield bytes(piece)


def _json_parts(value: Any) -> Iterator[str | bytes]:
    """``value`` as :func:`sse` encodes it, in parts: dicts key by key, lists a slice at a time, the
    rest by the C encoder. Written by hand because the standard library's incremental encoder
    (``JSONEncoder.iterencode``) runs in pure Python: four times slower on a large result."""
    if isinstance(value, StoredJSON):
        yield from stored_pieces(value.data, PIECE_BYTES)
    elif isinstance(value, dict):
        yield "{"
        for index, (key, item) in enumerate(value.items()):
            yield ("," if index else "") + _dumps(key) + ":"  # job views come from JSON: keys are str
            yield from _json_parts(item)
        yield "}"
    elif isinstance(value, list | tuple):
        yield "["
        for start in range(0, len(value), _SLICE):
            items = value[start:start + _SLICE]
            if any(isinstance(item, dict) for item in items):  # choices: each may be large
                for index, item in enumerate(items):
                    if start or index:
                        yield ","
                    yield from _json_parts(item)
            else:  # token ids, logprobs, top-k entries: small items, a slice at once
                yield ("," if start else "") + _dumps(list(items))[1:-1]
        yield "]"
    else:
        yield _dumps(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class StreamSlots:
    """The streams one API process serves at once, and of those one key holds at most
    ``per_key`` (so one key's streams, or readers that never read, leave slots to the others).
    Never blocks: a stream past either bound is a 503."""

    def __init__(self, slots: int, per_key: int | None = None):
        self.slots = slots
        self.per_key = slots if per_key is None else min(per_key, slots)
        self._lock = threading.Lock()
        self._taken: dict[str, int] = {}

    def take(self, owner: str = "") -> Callable[[], None]:
        with self._lock:
            if sum(self._taken.values()) >= self.slots:
                raise TooManyStreamsError("this API process serves as many streams as it may "
                                          "(ROLLOUT_API_STREAM_SLOTS); retry shortly", headers={"Retry-After": "1"})
            if self._taken.get(owner, 0) >= self.per_key:
                raise TooManyStreamsError("this key holds as many streams of this API process as a key may "
                                          "(ROLLOUT_API_STREAM_SLOTS_PER_KEY); retry when one ends",
                                          headers={"Retry-After": "1"})
            self._taken[owner] = self._taken.get(owner, 0) + 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                self._taken[owner] -= 1
                if not self._taken[owner]:
                    del self._taken[owner]

        return release


def stream_response(svc, chunks: Iterable[bytes], *, on_close: tuple[Callable[[], None], ...] = (),
                    release: Callable[[], None] | None = None) -> Response:
    """An SSE response over ``chunks`` holding one stream slot (``release`` gives back one taken
    already); ``on_close`` runs when the server closes the response: at its end, or when the
    client went away (the next write failed)."""
    release = release or svc.stream_slots.take(current_owner())
    response = Response(chunks, mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.call_on_close(release)
    for callback in on_close:
        response.call_on_close(callback)
    return response


def last_event_id(header: str | None, query: str | None) -> str:
    """Where a resumed stream starts: the Last-Event-ID header (EventSource sends it on reconnect)
    or ``?last_event_id=``; the start of the stream without either."""
    value = header or query
    if not value:
        return "0"
    if not plausible_event_id(value):
        raise InvalidRequestError("Last-Event-ID: not an event id of this stream",
                                  errors={"Last-Event-ID": ["must be an id this stream sent"]})
    return value


def job_events(svc, job_id: str, after: str) -> Iterator[bytes]:
    """The native events of one job: ``status``, ``restart`` and ``tokens`` as stored (each with its
    id), keep-alive comments while idle, then ``result`` (the job as GET /v1/jobs/{id} shows it, its
    result sent from the stored bytes, never decoded) or, for a failed job, ``error``. A dead
    attempt's late tokens are left out (see job_events)."""
    attempts = AttemptFilter()
    try:
        for item in follow(svc.event_hub, svc.jobs, {job_id: after}, keepalive=svc.settings.stream_keepalive_seconds,
                           outage_s=svc.settings.stream_outage_seconds, stored_results=True):
            if isinstance(item, KeepAlive):
                yield KEEPALIVE
                continue
            _, event = item
            if isinstance(event, Ended):
                job = event.job
                if job.get("status") == "failed":
                    yield sse({**(job.get("error") or {"code": "internal_error", "message": "job failed"}),
                               "job_id": job_id}, event="error")
                else:
                    if isinstance(job.get("result"), StoredJSON):  # in the record: nothing keeps this read's copy
                        job["result"] = _SENDING.setdefault(job_id, job["result"])
                    yield from sse_pieces(public_job(job), event="result")
                return
            if attempts.keep(job_id, event):
                yield sse(event.data, event=event.type, event_id=event.id)
    except STORE_FAILURES:  # before RolloutError: the domain's store errors are typed ones too
        # Redis away past ROLLOUT_STREAM_OUTAGE_SECONDS: the stream ends, the job does not (an
        # ``error`` event would say it failed). The client resumes with the last id it read.
        yield sse({"code": "stream_interrupted", "message": "the job store is unavailable; resume with "
                   "Last-Event-ID", "job_id": job_id, "retryable": True}, event="interrupted")
    except RolloutError as error:
        yield sse(error.to_dict(), event="error")
    except GeneratorExit:
        raise
    except Exception:
        log.exception("job %s: unexpected error while streaming its events", job_id)
        yield sse({"code": "internal_error", "message": "internal error while streaming"}, event="error")
