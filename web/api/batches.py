"""/v1/batches: run a JSONL file of job requests offline, follow it, download its results.

Two ways in, one resource: a file uploaded with the request (multipart form or JSONL body), or a
JSON body ``{input_file_id, endpoint, completion_window, metadata}`` naming a file uploaded to
``/v1/files`` (OpenAI's Batch API; ``web.dialects.openai.batch_object`` says which view of the batch a call
gets). Each line of the file is ours, ``{"custom_id": ..., "kind": "generate" | "score", "body":
<job request>}``, or OpenAI's ``{"custom_id", "method", "url", "body"}`` (``web.dialects.openai.batch_lines``).
The body is checked by the same schema and limits as ``POST /v1/jobs`` (the line's ``kind`` wins
over ``body.kind``). An invalid line does not fail the batch: it goes to the batch's errors with
its line number, and the batch runs the other lines; only a file without one valid line is refused
(422). The file is validated here, in the API process, a block at a time; ``domain.batches.creation``
stores each block's valid lines in Redis as it comes (its score lines start scoring while the rest
is read), and the jobs are made by ``rollout.batches.enqueue_chunk``, one Celery message per chunk
of lines.
"""


from __future__ import annotations

from flask import Response, request
from flask.views import MethodView

from domain.batches.creation import BatchIntake
from domain.batches.messages import request_cancel
from domain.batches.statuses import TERMINAL
from web.api.batch_schemas import (
    BatchListQuerySchema,
    BatchListSchema,
    BatchPollQuerySchema,
    BatchSchema,
    FileBatchSchema,
    ViewQuerySchema,
)
from web.api.batch_upload import (
    JSONL_TYPES,
    REFUSED_LINE_ERRORS,
    InvalidBatchError,
    check_lines,
    load_params,
    read_file_batch,
    read_upload,
)
from web.api.long_poll import long_wait
from web.auth import current_owner
from web.blueprint import Blueprint
from web.dialects.openai.batch_object import batch_view
from web.services import services

blp = Blueprint("batches", __name__, url_prefix="/v1/batches", description="Offline batches of jobs from JSONL files")

_UPLOAD_DOC = {
    "required": True,
    "content": {
        "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
            "file": {"type": "string", "format": "binary", "description": "The JSONL file"},
            "completion_window": {"type": "string"},
            "metadata": {"type": "string", "description": "A JSON object"},
            "webhook": {"type": "string", "description": "JSON {url, events}"},
        }}},
        **{kind: {"schema": {"type": "string", "description": "The JSONL file itself"}} for kind in JSONL_TYPES},
        "application/json": {"schema": FileBatchSchema},
    },
}
_PARAMS_DOC = [
    {"in": "query", "name": name, "required": False, "schema": {"type": "string"}, "description": text}
    for name, text in (("completion_window", "e.g. 24h (also accepted as a form field)"),
                       ("metadata", "JSON object (also a form field)"),
                       ("webhook", "JSON {url, events} (also a form field)"))
]
_JSONL_DOC = {"content": {"application/jsonl": {"schema": {"type": "string"}}}}


# --- Views ----------------------------------------------------------------------------------------

@blp.route("")
class Batches(MethodView):
    @blp.doc(requestBody=_UPLOAD_DOC, parameters=_PARAMS_DOC)
    @blp.response(202, BatchSchema, headers={"Location": {"description": "The batch's URL", "schema": {"type": "string"}}})
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(413, schema=None, description="More than ROLLOUT_BATCH_MAX_LINES lines or ROLLOUT_BATCH_MAX_BYTES bytes")
    @blp.alt_response(415, schema=None, description="Neither multipart/form-data nor a JSONL content type")
    @blp.alt_response(422, schema=None, description="Invalid parameters, or no valid line (the first line errors are listed)")
    @blp.alt_response(429, schema=None, description="The key's unfinished batches hold ROLLOUT_BATCH_MAX_STORED_BYTES_PER_KEY")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def post(self):
        """Run a JSONL file of requests as a batch: upload it here, or name one uploaded to /v1/files
        (JSON body, OpenAI's batch create)."""
        svc = services()
        svc.redis_memory.admit()  # 503 redis_memory_full at Redis' high-water mark, before reading the file
        settings = svc.settings
        source: dict[str, str] = {}
        if request.mimetype == "application/json":
            data, options, endpoint = read_file_batch(settings)
            source = {"api": "openai", "endpoint": endpoint, "input_file_id": options.pop("input_file_id")}
        else:
            data, params = read_upload(settings.batch_max_bytes)
            options, endpoint = load_params(params, settings), None
        total, blocks = check_lines(data, max_lines=settings.batch_max_lines, endpoint=endpoint)
        if not total:
            raise InvalidBatchError("the file has no lines", errors=[])
        # Stored as it is checked: the batch's score lines start while the rest is read.
        with BatchIntake(svc, current_owner(), total=total, source=source, **options) as intake:
            for block in blocks:
                intake.add(block)
            if not intake.valid_lines:
                raise InvalidBatchError("no valid line in the file", errors=intake.first_errors[:REFUSED_LINE_ERRORS])
            batch_id = intake.close()["id"]
        batch = svc.batches.get(batch_id)
        return batch_view(batch), 202, {"Location": f"/v1/batches/{batch_id}"}

    @blp.arguments(BatchListQuerySchema, location="query", unknown="raise")
    @blp.response(200, BatchListSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(422, schema=None, description="Invalid query")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, query):
        """The caller's own batches, newest first (each in its view); ``cursor`` or OpenAI's ``after``."""
        store = services().batches
        owner = current_owner()
        cursor = query.get("cursor")
        if "after" in query:
            cursor = repr(store.get(query["after"], owner=owner)["created_at"])
        batches, cursor = store.list(owner=owner, status=query.get("status"), limit=query["limit"], cursor=cursor)
        return {"object": "list", "data": [batch_view(batch) for batch in batches],
                "first_id": batches[0]["id"] if batches else None, "last_id": batches[-1]["id"] if batches else None,
                "has_more": cursor is not None, "next_cursor": cursor}


@blp.route("/<string:batch_id>")
class Batch(MethodView):
    @blp.arguments(BatchPollQuerySchema, location="query", unknown="raise")
    @blp.response(200, BatchSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such batch for this key")
    @blp.alt_response(422, schema=None, description="Invalid query")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, query, batch_id):
        """A batch, with its request counts; with ``?wait=S``, answer when it ends or after S
        seconds, at most ROLLOUT_SYNC_TIMEOUT_MAX (long polling)."""
        store = services().batches
        batch = store.get(batch_id, owner=current_owner())  # 404 for another key's batch, before any wait
        if query.get("wait") and batch["status"] not in TERMINAL:
            with long_wait(query["wait"]) as wait:
                if wait:
                    batch = store.wait(batch_id, timeout=wait)
        return batch_view(batch)


@blp.route("/<string:batch_id>/cancel")
class BatchCancel(MethodView):
    @blp.arguments(ViewQuerySchema, location="query", unknown="raise")
    @blp.response(200, BatchSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such batch for this key")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def post(self, _query, batch_id):
        """Cancel a batch: lines not started are cancelled, lines done are kept. Idempotent."""
        svc = services()
        store = svc.batches
        store.get(batch_id, owner=current_owner())
        if store.move(batch_id, "cancelling", from_=("in_progress",)):
            request_cancel(svc.celery, batch_id)
        return batch_view(store.get(batch_id))


@blp.route("/<string:batch_id>/output")
class BatchOutput(MethodView):
    @blp.doc(responses={"200": {"description": "One JSON line per succeeded request: "
                                               "{custom_id, line, job_id, response: {status_code, body}}", **_JSONL_DOC}})
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such batch for this key")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, batch_id):
        """The results so far, as JSONL (in no particular order)."""
        return _stream_results(batch_id, "output")


@blp.route("/<string:batch_id>/errors")
class BatchErrors(MethodView):
    @blp.doc(responses={"200": {"description": "One JSON line per failed request or invalid line: "
                                               "{custom_id, line, job_id?, error: {code, message}}", **_JSONL_DOC}})
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such batch for this key")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, batch_id):
        """The errors so far, as JSONL (in no particular order)."""
        return _stream_results(batch_id, "errors")


def _stream_results(batch_id: str, which: str) -> Response:
    store = services().batches
    batch = store.get(batch_id, owner=current_owner())

    def pages():
        for page in store.iter_results(batch_id, which):
            yield b"\n".join(page) + b"\n"

    headers = {"Content-Disposition": f'attachment; filename="{batch_id}_{which}.jsonl"',
               "X-Batch-Status": batch["status"]}
    return Response(pages(), mimetype="application/jsonl", headers=headers)


# --- Reading and checking the file ----------------------------------------------------------------

