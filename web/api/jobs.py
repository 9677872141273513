"""/v1/jobs: submit, poll, list and cancel jobs."""

from __future__ import annotations

import time

from flask import request as http_request
from flask.views import MethodView

from domain.jobs.idempotency import Answer
from domain.jobs.store import TERMINAL, QueueFullError
from domain.jobs.view import listed_job, public_job
from domain.lifecycle import cancel_job
from engine.errors import NotFoundError
from web.api import idempotency
from web.api.idempotency import answered_job, job_answer, once, replay_headers
from web.api.job_reply import job_reply
from web.api.long_poll import long_wait
from web.api.schemas import (
    BulkSubmitResultSchema,
    BulkSubmitSchema,
    JobListQuerySchema,
    JobListSchema,
    JobLookupResultSchema,
    JobLookupSchema,
    JobPollQuerySchema,
    JobSchema,
    SubmitJobSchema,
)
from web.api.streams import job_events, last_event_id, stream_response
from web.api.submit import confirm_created, submit, submit_many
from web.auth import current_owner
from web.blueprint import Blueprint
from web.services import services

blp = Blueprint("jobs", __name__, url_prefix="/v1/jobs", description="Generation and scoring jobs")

ERRORS_SUBMIT = (401, 413, 422, 429, 503)


@blp.route("")
class Jobs(MethodView):
    @blp.arguments(SubmitJobSchema)
    @blp.response(202, JobSchema, headers={"Location": {"description": "The job's URL", "schema": {"type": "string"}}})
    @idempotency.documented(blp)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(413, schema=None, description="Body too large")
    @blp.alt_response(422, schema=None, description="Invalid request")
    @blp.alt_response(429, schema=None, description="Too many unfinished jobs")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def post(self, request):
        """Submit a job (kind generate or score). With an ``Idempotency-Key``, sending it again
        answers the same job."""
        body = dict(request)
        watched = request.pop("stream_events")
        made = once("POST /v1/jobs", body, lambda: submit(request, watched=watched, confirm=False), job_answer)
        job = public_job(answered_job(made))
        confirm_created([job["id"]])  # after the key holds the job: a 503 here is sent again, and replayed
        return job, 202, {"Location": job["links"]["self"], **replay_headers(made)}

    @blp.arguments(JobListQuerySchema, location="query", unknown="raise")
    @blp.response(200, JobListSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(422, schema=None, description="Invalid query")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, query):
        """The caller's own jobs, newest first, each without its ``result`` (read it with ``GET /v1/jobs/{id}``)."""
        jobs, cursor = services().jobs.list(owner=current_owner(), status=query.get("status"),
                                            limit=query["limit"], cursor=query.get("cursor"))
        return {"data": [listed_job(job) for job in jobs], "next_cursor": cursor}


@blp.route("/bulk")
class BulkSubmit(MethodView):
    @blp.arguments(BulkSubmitSchema)
    @blp.response(202, BulkSubmitResultSchema, headers={"Retry-After": {
        "description": "When some requests were refused: seconds before sending them again", "schema": {"type": "string"}}})
    @idempotency.documented(blp)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(413, schema=None, description="Body too large")
    @blp.alt_response(422, schema=None, description="A request is invalid (its place named in errors): none was created")
    @blp.alt_response(429, schema=None, description="The queue caps refused every request")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def post(self, body):
        """Submit many jobs in one request (a trainer's rollout step): created in one round trip and
        queued together, so the GPU workers get them at once. Requests the queue caps refuse come
        back in ``refused``; when every one was refused the answer is a 429 like a single submit's.
        With an ``Idempotency-Key``, sending it again answers the same jobs and refusals."""
        made = once("POST /v1/jobs/bulk", body, lambda: _submit_bulk(body["jobs"]), _bulk_answer)
        answer = made if isinstance(made, Answer) else _bulk_answer(made)
        jobs = _replayed_jobs(answer) if isinstance(made, Answer) else [
            None if isinstance(job, QueueFullError) else job for job in made]
        confirm_created([job_id for job_id in answer.job_ids if job_id is not None])
        reply = {"data": [None if job is None else public_job(job) for job in jobs], "refused": list(answer.refused)}
        headers = {"Retry-After": answer.retry_after} if answer.retry_after else {}
        return reply, 202, {**headers, **replay_headers(made)}


def _submit_bulk(requests: list[dict]) -> list[dict | QueueFullError]:
    """Each request's job, or the QueueFullError the queue caps refused it with; when every one was
    refused, the first refusal is raised: nothing was made (the key stays free)."""
    outcomes = submit_many(requests, confirm=False)
    refused = [error for error in outcomes if isinstance(error, QueueFullError)]
    if len(refused) == len(outcomes):
        raise refused[0]
    return outcomes


def _bulk_answer(outcomes: list) -> Answer:
    refused = [(index, error) for index, error in enumerate(outcomes) if isinstance(error, QueueFullError)]
    return Answer(tuple(None if isinstance(job, QueueFullError) else job["id"] for job in outcomes),
                  tuple({"index": index, "code": error.code, "message": error.message} for index, error in refused),
                  refused[0][1].headers.get("Retry-After") if refused else None)


def _replayed_jobs(answer: Answer) -> list[dict | None]:
    """The jobs a bulk submit made, read again for its replayed answer (None where it refused one)."""
    made = [job_id for job_id in answer.job_ids if job_id is not None]
    found = dict(zip(made, services().jobs.owned(made, current_owner()), strict=True))
    if any(job is None for job in found.values()):
        raise NotFoundError("a job this submit made is gone")
    return [None if job_id is None else found[job_id] for job_id in answer.job_ids]


@blp.route("/lookup")
class JobLookup(MethodView):
    @blp.arguments(JobLookupSchema)
    @blp.response(200, JobLookupResultSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(422, schema=None, description="Invalid body (no ids, more than 1,000)")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def post(self, body):
        """Many jobs in one request (a trainer following a step's rollouts); with ``wait``, answer
        once every one of them has ended or after ``wait`` seconds."""
        svc, owner = services(), current_owner()
        ids = list(dict.fromkeys(body["ids"]))
        jobs = svc.jobs.owned(ids, owner)
        running = {job["id"]: place for place, job in enumerate(jobs) if job is not None and job["status"] not in TERMINAL}
        with long_wait(body.get("wait", 0.0)) as wait:
            deadline = time.monotonic() + wait
            while running and (left := deadline - time.monotonic()) > 0:
                ended = svc.jobs.wait_any(list(running), timeout=left)
                if not ended:
                    break
                for job_id, job in ended.items():  # the caller's already: checked by the first read
                    jobs[running.pop(job_id)] = job
        return {"data": [public_job(job) for job in jobs if job is not None],
                "missing": [job_id for job_id, job in zip(ids, jobs, strict=True) if job is None]}


@blp.route("/<string:job_id>")
class Job(MethodView):
    @blp.arguments(JobPollQuerySchema, location="query", unknown="raise")
    @blp.response(200, JobSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such job for this key")
    @blp.alt_response(422, schema=None, description="Invalid query")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, query, job_id):
        """Poll a job; with ``?wait=S``, answer when it ends or after S seconds, at most
        ROLLOUT_SYNC_TIMEOUT_MAX (long polling: one request instead of one per poll interval)."""
        svc = services()
        # 404 for another key's job, before any wait; the result as stored: sent on, never decoded.
        job = svc.jobs.get(job_id, owner=current_owner(), stored_result=True)
        if query.get("wait") and job["status"] not in TERMINAL:  # an ended job is answered as read
            with long_wait(query["wait"]) as wait:
                if wait:
                    job = (svc.jobs.wait(job_id, timeout=wait, stored_result=True)
                           or svc.jobs.get(job_id, stored_result=True))
        return job_reply(job)

    @blp.response(200, JobSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such job for this key")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def delete(self, job_id):
        """Cancel a job. Idempotent; a finished job is returned unchanged."""
        return public_job(cancel_job(services(), job_id, owner=current_owner()))


@blp.route("/<string:job_id>/events")
class JobEventStream(MethodView):
    @blp.response(200, description="Server-Sent Events: ``status``, ``restart``, ``tokens``, then ``result`` or "
                                   "``error``; each stored event has an ``id`` that Last-Event-ID resumes after",
                  content_type="text/event-stream")
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such job for this key")
    @blp.alt_response(422, schema=None, description="Last-Event-ID is not an event id")
    @blp.alt_response(503, schema=None, description="Job store unavailable, or too many streams")
    def get(self, job_id):
        """Follow a job: its events as they happen, from the start or after ``Last-Event-ID`` (the
        header, or ``?last_event_id=``). A view of a durable job: disconnecting cancels nothing."""
        svc = services()
        svc.jobs.check_owner(job_id, current_owner())  # 404 for another key's job
        after = last_event_id(http_request.headers.get("Last-Event-ID"), http_request.args.get("last_event_id"))
        return stream_response(svc, job_events(svc, job_id, after))
