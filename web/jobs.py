"""/v1/jobs: submit, poll, list and cancel jobs."""

from __future__ import annotations

from flask.views import MethodView

from web.auth import current_owner
from web.blueprint import Blueprint
from web.schemas import JobListQuerySchema, JobListSchema, JobRequestSchema, JobSchema
from web.services import services
from web.submit import submit
from workers.job_view import public_job
from workers.lifecycle import cancel_job

blp = Blueprint("jobs", __name__, url_prefix="/v1/jobs", description="Generation and scoring jobs")

ERRORS_SUBMIT = (401, 413, 422, 429, 503)


@blp.route("")
class Jobs(MethodView):
    @blp.arguments(JobRequestSchema)
    @blp.response(202, JobSchema, headers={"Location": {"description": "The job's URL", "schema": {"type": "string"}}})
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(413, schema=None, description="Body too large")
    @blp.alt_response(422, schema=None, description="Invalid request")
    @blp.alt_response(429, schema=None, description="Too many unfinished jobs")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def post(self, request):
        """Submit a job (kind generate or score)."""
        job = public_job(submit(request))
        return job, 202, {"Location": job["links"]["self"]}

    @blp.arguments(JobListQuerySchema, location="query", unknown="raise")
    @blp.response(200, JobListSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(422, schema=None, description="Invalid query")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, query):
        """The caller's own jobs, newest first."""
        jobs, cursor = services().jobs.list(owner=current_owner(), status=query.get("status"),
                                            limit=query["limit"], cursor=query.get("cursor"))
        return {"data": [public_job(job) for job in jobs], "next_cursor": cursor}


@blp.route("/<string:job_id>")
class Job(MethodView):
    @blp.response(200, JobSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such job for this key")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, job_id):
        """Poll a job."""
        return public_job(services().jobs.get(job_id, owner=current_owner()))

    @blp.response(200, JobSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such job for this key")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def delete(self, job_id):
        """Cancel a job. Idempotent; a finished job is returned unchanged."""
        return public_job(cancel_job(services(), job_id, owner=current_owner()))
