"""``stream: true`` for every dialect: submit the jobs, follow their events, let the dialect shape
each chunk, and cancel the jobs when the client goes away.

A dialect gives :func:`dialect_stream` a :class:`ChunkWriter`: ``delta`` for new tokens of one
choice, ``done`` with a job that ended (its result as the non-streamed reply sees it), ``end`` for
what follows the last job (usage chunks: it gets the ended jobs with their results' usage only),
and ``error`` for the dialect's in-stream error shape. Once a job's chunks are made, the stream
keeps them and drops the job's record and ledger: a reader that stops reading holds its reply's
bytes, not the objects they were made of.
The tokens come through :class:`domain.jobs.follow.TokenLedger`: each once, in order, equal to the
result's (the ledger's ``finish`` checks it), also across a redo after a worker died.

Disconnect: the WSGI server closes the response when a write fails; a stream that did not reach
its end then cancels its unfinished jobs (they end ``cancelled`` with their tokens so far). An idle
stream writes keep-alive comments, so a client that left is noticed within a few of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

from domain.infra.store_errors import STORE_FAILURES
from domain.jobs.follow import ChoiceDelta, Ended, KeepAlive, TokenLedger, follow
from domain.jobs.results import JobResult
from domain.jobs.store import TERMINAL
from domain.lifecycle import cancel_job
from engine.errors import InternalError, RolloutError, ServiceUnavailableError
from web.api.streams import KEEPALIVE, sse, stream_response
from web.api.submit import submit
from web.auth import current_owner
from web.dialects.common import job_error
from web.services import services

log = logging.getLogger(__name__)

DONE = sse("[DONE]")


class ChunkWriter(Protocol):
    def bind(self, jobs: list[dict[str, Any]]) -> None: ...

    def delta(self, job: dict[str, Any], delta: ChoiceDelta, ledger: TokenLedger) -> list[bytes]: ...

    def done(self, job: dict[str, Any], finals: list[ChoiceDelta], ledger: TokenLedger) -> list[bytes]: ...

    def end(self, jobs: list[dict[str, Any]]) -> list[bytes]: ...

    def error(self, error: RolloutError) -> bytes: ...


def dialect_stream(requests: list[dict[str, Any]], writer: ChunkWriter):
    """Submit ``requests`` (native, one job each) and answer with their stream."""
    svc, owner = services(), current_owner()
    release = svc.stream_slots.take(owner)  # before any job exists: a refused stream leaves nothing behind
    jobs: list[dict[str, Any]] = []
    try:
        for request in requests:
            jobs.append(submit(request, watched=True))
    except Exception:
        release()
        _cancel(svc, owner, jobs)
        raise
    writer.bind(jobs)
    state = {"complete": False}

    def cancel_unless_complete() -> None:
        if not state["complete"]:
            _cancel(svc, owner, jobs)

    return stream_response(svc, _chunks(svc, jobs, writer, state), on_close=(cancel_unless_complete,),
                           release=release)


def _chunks(svc, jobs: list[dict[str, Any]], writer: ChunkWriter, state: dict) -> Iterator[bytes]:
    ledger = TokenLedger()
    by_id = {job["id"]: job for job in jobs}
    ended: dict[str, dict[str, Any]] = {}
    try:
        for item in follow(svc.event_hub, svc.jobs, {job["id"]: "0" for job in jobs},
                           keepalive=svc.settings.stream_keepalive_seconds, outage_s=svc.settings.stream_outage_seconds):
            if isinstance(item, KeepAlive):
                yield KEEPALIVE
                continue
            job_id, event = item
            if isinstance(event, Ended):
                ended[job_id], chunks = _job_end(job_id, event.job, writer, ledger)
                del item, event  # the record: while the chunks wait for the reader, they alone are held
                yield from chunks
                continue
            for delta in ledger.take(job_id, event):
                if delta.token_ids or delta.text:
                    yield from writer.delta(by_id[job_id], delta, ledger)
        yield from writer.end([ended.get(job["id"], job) for job in jobs])
        state["complete"] = True
        yield DONE
    except STORE_FAILURES:  # before RolloutError: the domain's store errors are typed ones too
        yield writer.error(ServiceUnavailableError("the job store is unavailable"))
        yield DONE
    except RolloutError as error:
        yield writer.error(error)
        yield DONE
    except GeneratorExit:
        raise
    except Exception:
        log.exception("unexpected error while streaming a dialect reply")
        yield writer.error(InternalError("internal error while streaming"))
        yield DONE


def _job_end(job_id: str, job: dict[str, Any], writer: ChunkWriter,
             ledger: TokenLedger) -> tuple[dict[str, Any], list[bytes]]:
    """What ``end`` keeps of an ended job (its usage) and the chunks that end it; the ledger forgets it."""
    if job.get("status") == "failed":
        raise job_error(job)
    finals = ledger.finish(job_id, JobResult.of(job, n=0).choices)  # none: the dialect ends each aborted
    chunks = writer.done(job, finals, ledger)
    ledger.forget(job_id)
    result = job.get("result")
    if result:
        job = {**job, "result": {"usage": result.get("usage"), "cached_tokens": result.get("cached_tokens")}}
    return job, chunks


def _cancel(svc, owner: str, jobs: list[dict[str, Any]]) -> None:
    for job in jobs:
        try:
            if svc.jobs.get(job["id"], owner=owner)["status"] not in TERMINAL:
                cancel_job(svc, job["id"], owner=owner)
        except (RolloutError, *STORE_FAILURES):
            pass  # gone, or the store is away: nothing more can be done from here
