"""Checks a validated request against the service's limits, then submits it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import flask
from flask import has_request_context

from domain.infra.replication import confirm_if_asked
from domain.jobs.request import JobRequest
from domain.jobs.store import QueueFullError
from domain.jobs.submission import new_job_ids, result_reservations, submit_job, submit_jobs
from engine.capacity import check_capacity
from engine.errors import InvalidRequestError, PlaceholderMismatchError, RolloutError, check_token_ids
from engine.request_rules import (
    check_context,
    check_media_count,
    check_metadata,
    new_tokens_of,
    sampling_knob_problems,
)
from engine.result_bound import check_result_size, request_result_bound
from engine.routing.shape import check_routing_asked
from web.api.adapters import with_adapter
from web.api.sampling_mask import check_sampling_mask
from web.api.session_header import with_session
from web.auth import current_owner
from web.services import services


def check_limits(request: dict[str, Any], *, vocabulary_checked: bool = False) -> dict[str, Any]:
    """Apply the configured limits and fill defaults; returns the request as it will be stored.
    ``vocabulary_checked``: a dialect's ``native_request`` checked the token ids against the model's
    vocabulary already (naming the dialect's fields); a batch file's thousands of lines skip the
    second pass over every id."""
    svc = services()
    limits = svc.limits
    check_media_count(len(request.get("content_parts") or []), limits.media.max_items)
    check_metadata(request.get("metadata"), limits.max_metadata_bytes)
    params = request["sampling_params"]
    if not vocabulary_checked:
        check_vocabulary(request, svc.model_facts.vocab_size)
    params.setdefault("max_tokens", limits.default_max_tokens)
    if problems := sampling_knob_problems(params):  # again, now that max_tokens has its default
        raise InvalidRequestError("invalid sampling parameters", errors={
            "sampling_params": {field: [problem] for field, problem in problems.items()}})
    check_sampling_mask(params, svc.model_facts.vocab_size)
    check_routing_asked(params, svc.model_facts.routed_bytes_per_token)
    check_placeholders_have_media(request, svc.model_facts.placeholder_token_ids)
    prompt_len = len(request.get("token_ids") or [])
    # A prompt given as text is counted once tokenized, on the CPU worker (the same check).
    check_context(prompt_len, new_tokens_of(request.get("kind", "generate"), params["max_tokens"],
                                            request.get("completion_token_ids")), limits.context_tokens)
    if request.get("kind", "generate") == "generate":
        # Image placeholders are expanded later; a prompt that can never fit is refused now.
        check_capacity(limits.scheduler, prompt_len, params["max_tokens"], params.get("n", 1))
    check_result_size(result_bound(request), limits.max_result_bytes)
    return request


def result_bound(request: dict[str, Any]) -> int:
    """The most bytes ``request``'s result can take (engine/result_bound.py), as admission counts it."""
    svc = services()
    return request_result_bound(request, context_tokens=svc.limits.context_tokens,
                                vocab_size=svc.model_facts.vocab_size,
                                routed_bytes_per_token=svc.model_facts.routed_bytes_per_token)


def check_placeholders_have_media(request: dict[str, Any], placeholder_ids: frozenset[int]) -> None:
    """A token prompt holding media placeholder ids must come with media (``content_parts`` or
    ``features``): a sampled ``<|image_pad|>`` fed back in an agent's next turn without its image
    would fail in the GPU worker (the model's rope index), so it is refused before queueing."""
    token_ids = request.get("token_ids")
    if not token_ids or not placeholder_ids or request.get("content_parts") or request.get("features"):
        return
    if not placeholder_ids.isdisjoint(token_ids):  # one C pass: a batch file checks thousands of lines
        count = sum(1 for t in token_ids if t in placeholder_ids)
        raise PlaceholderMismatchError(
            f"token_ids hold {count} media placeholder ids but the request carries no media; give the media "
            "(content_parts or features) or drop the placeholders", placeholders=count, items=0)


def check_vocabulary(request: dict[str, Any], vocab_size: int | None) -> None:
    """Every token id of ``request`` (as the native schema loaded it) must be one the model has
    (TokenIdOutOfRangeError, 422, names the field and index), so a bad id never reaches a GPU
    batch shared with other keys' jobs. The engine checks again (engine.batch_inputs), for jobs
    that come by other ways."""
    if vocab_size is None:  # a config without vocab_size: the engine's check alone holds
        return
    for field, token_ids in (("token_ids", request.get("token_ids")),
                             ("completion_token_ids", request.get("completion_token_ids")),
                             ("sampling_params.stop_token_ids", request["sampling_params"].get("stop_token_ids"))):
        # The native schema's id fields (web.api.schemas.TokenIds, TokenId) pass only lists of ints
        # from 0: the upper bound is all that is left, one C pass (a quarter of the full check on
        # a chat line's 564 ids); the full check then names the first bad id.
        if token_ids and max(token_ids) >= vocab_size:
            check_token_ids(token_ids, vocab_size, field)


def submit(request: dict[str, Any], *, watched: bool = False, confirm: bool = True) -> dict[str, Any]:
    """Check the validated ``request`` against the limits, type it, reserve what its result may
    take, store and enqueue its job (``watched``: the caller streams its events). ``confirm=False``:
    the caller confirms (:func:`confirm_created`) once it recorded the job under its idempotency key."""
    svc = services()
    svc.redis_memory.admit()
    checked = checked_request(request)
    job_ids = new_job_ids(1)
    with reserved(job_ids, [checked], watched=watched):
        job = submit_job(svc.jobs, svc.celery, owner=current_owner(), request=checked, model=svc.model_facts,
                         watched=watched, job_id=job_ids[0])
    if confirm:
        confirm_created([job["id"]])
    return job


@contextmanager
def reserved(job_ids: list[str], requests: list[JobRequest], *, watched: bool = False) -> Iterator[None]:
    """Each job's result bound (``domain.jobs.submission.result_reservations``) reserved against
    Redis' headroom under its id, all at once:
    503 ``redis_memory_full`` when they do not fit (domain/infra/redis_reservations.py). The job's
    end releases its reservation; a job the block does not make (an error, a queue cap) is released
    here. An unbounded Redis reserves nothing."""
    svc = services()
    if not svc.redis_memory.read().bounded:
        yield
        return
    svc.reservations.reserve(result_reservations(job_ids, requests, limits=svc.limits,
                                                 vocab_size=svc.model_facts.vocab_size, watched=watched,
                                                 routed_bytes_per_token=svc.model_facts.routed_bytes_per_token))
    try:
        yield
    except BaseException:
        svc.reservations.release(job_ids)
        raise


def confirm_created(job_ids: list[str]) -> None:
    """With replicas, a 202 means the jobs survive the primary's death: one confirmation covers
    every write before it (README, ``ROLLOUT_REDIS_REPLICA_ACKS``)."""
    if job_ids:
        confirm_if_asked(services(), ",".join(job_ids))


def submit_many(requests: list[dict[str, Any]], *, confirm: bool = True) -> list[dict[str, Any] | QueueFullError]:
    """``submit`` for the list of ``POST /v1/jobs/bulk``: every request is checked first, so one the
    limits refuse fails the call with nothing created (its error names its place, ``jobs.N``);
    then :func:`submit_checked`."""
    checked = []
    for index, request in enumerate(requests):
        try:
            checked.append(checked_request(request))
        except RolloutError as error:
            raise _at_index(error, index) from None
    return submit_checked(checked, confirm=confirm)


def checked_request(request: dict[str, Any]) -> JobRequest:
    """A validated request checked against the limits and typed, as ``submit`` stores it (with the
    HTTP request's ``X-Session-ID``, on every route)."""
    if has_request_context():
        request = with_adapter(with_session(request, flask.request.headers))
    return JobRequest.from_dict(check_limits(request))


def submit_checked(requests: list[JobRequest], *, confirm: bool = True) -> list[dict[str, Any] | QueueFullError]:
    """The caller's jobs of ``requests`` created in one round trip and their messages sent in one
    more, so they reach the GPU workers together. Each one's job, or the QueueFullError its turn met
    under the caps (the others still run). Refused whole (503 ``redis_memory_full``) while Redis is at
    its high-water mark, or when their results' bounds do not fit below it beside what accepted jobs
    reserved: what it holds already may then still finish (domain/infra/redis_memory.py, :func:`reserved`)."""
    svc = services()
    svc.redis_memory.admit()
    job_ids = new_job_ids(len(requests))
    with reserved(job_ids, requests):
        outcomes = submit_jobs(svc.jobs, svc.celery, owner=current_owner(), requests=[(r, None) for r in requests],
                               model=svc.model_facts, job_ids=job_ids)
        svc.reservations.release([job_id for job_id, job in zip(job_ids, outcomes, strict=True)
                                  if isinstance(job, QueueFullError)])
    if confirm:
        confirm_created([job["id"] for job in outcomes if not isinstance(job, QueueFullError)])
    return outcomes


def _at_index(error: RolloutError, index: int) -> RolloutError:
    """``error`` (same type, code and status) naming the request of the list it is about."""
    where = f"jobs.{index}"
    return RolloutError.from_record({"code": error.code, "message": f"{where}: {error.message}",
                                     "errors": {where: error.errors if error.errors is not None else [error.message]}})
