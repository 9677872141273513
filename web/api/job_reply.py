"""``GET /v1/jobs/{id}``'s reply for a job whose result is read as stored: the result is sent from
the record's bytes (``web/api/stored_json.py``: packed masks written out as their lists), never
decoded into Python objects, which take about five times its bytes (#56: +1 GB in the API process
for one GET of a 190 MB record). A large one goes out in pieces as it is written."""

from __future__ import annotations

from typing import Any

from flask import Response

from domain.infra.redis_records import StoredJSON
from domain.jobs.view import public_job
from web.api.schemas import JobSchema
from web.api.streams import json_pieces

# A result up to this size is sent as one body (with its Content-Length); a larger one in pieces.
WHOLE_BYTES = 1 << 20
_SCHEMA = JobSchema()


def job_reply(job: dict[str, Any]) -> dict[str, Any] | Response:
    """The public job: a dict for the schema to dump where it holds no stored result, else a
    response whose body writes the result from its stored bytes."""
    view = public_job(job)
    stored = view["result"]
    if not isinstance(stored, StoredJSON):
        return view
    body = _SCHEMA.dump({**view, "result": None})  # the rest as the schema shows it
    body["result"] = stored
    if len(stored.data) <= WHOLE_BYTES:
        return Response(b"".join(json_pieces(body)), mimetype="application/json")
    return Response(json_pieces(body), mimetype="application/json")
