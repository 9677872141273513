"""/v1/batches: run a JSONL file of job requests offline, follow it, download its results.

Two ways in, one resource: a file uploaded with the request (multipart form or JSONL body), or a
JSON body ``{input_file_id, endpoint, completion_window, metadata}`` naming a file uploaded to
``/v1/files`` (OpenAI's Batch API; ``web.openai_batch_object`` says which view of the batch a call
gets). Each line of the file is ours, ``{"custom_id": ..., "kind": "generate" | "score", "body":
<job request>}``, or OpenAI's ``{"custom_id", "method", "url", "body"}`` (``web.openai_batch_lines``).
The body is checked by the same schema and limits as ``POST /v1/jobs`` (the line's ``kind`` wins
over ``body.kind``). An invalid line does not fail the batch: it goes to the batch's errors with
its line number, and the batch runs the other lines; only a file without one valid line is refused
(422). The file is validated here, in the API process; ``workers.batch_creation`` stores its valid
lines in Redis, and the jobs are made by ``rollout.batches.enqueue_chunk``, one Celery message per
chunk of lines.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

from flask import Response, request
from flask.views import MethodView
from marshmallow import Schema, ValidationError, fields, pre_load, validate
from werkzeug.exceptions import RequestEntityTooLarge, UnsupportedMediaType

from engine.errors import InvalidRequestError, RolloutError
from web.auth import current_owner
from web.blueprint import Blueprint
from web.json_body import InvalidJsonError, UnsupportedJsonValueError, parse_json
from web.openai_batch_lines import (
    ENDPOINTS,
    JOBS_URL,
    LineShapeError,
    check_endpoint,
    is_openai_line,
    read_line,
)
from web.openai_batch_object import VIEWS, batch_view
from web.schemas import JOB_KINDS, JobRequestSchema, ListQuerySchema
from web.services import services
from web.submit import check_limits
from workers.batch_creation import BatchTooLargeError, ParsedBatch, create_batch
from workers.batch_progress import batch_store
from workers.batch_store import STATUSES
from workers.file_store import file_store
from workers.tasks.batches import request_cancel
from workers.webhooks import BATCH_EVENTS

blp = Blueprint("batches", __name__, url_prefix="/v1/batches", description="Offline batches of jobs from JSONL files")

JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "text/plain")
# Inputs and results of a running batch sit in Redis for its whole window: a week bounds that.
MAX_COMPLETION_WINDOW = 7 * 24 * 3600
MIN_COMPLETION_WINDOW = 60
# Line errors shown in a 422 (the batch object shows workers.batch_creation.REPORTED_LINE_ERRORS).
REFUSED_LINE_ERRORS = 5
# Room for the multipart boundaries and the form fields around the file.
MULTIPART_OVERHEAD = 64 * 1024
# At most 9 digits: past that the window is out of range anyway, and int() of thousands of digits raises.
_WINDOW = re.compile(r"^\s*(\d{1,9})\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class InvalidBatchError(InvalidRequestError):
    """The file has no valid line (or none at all); ``errors`` lists the first line errors."""

    code = "invalid_batch"


# --- Schemas --------------------------------------------------------------------------------------

class JsonText(fields.Field):
    """A form or query field carrying JSON text, loaded by ``inner``."""

    def __init__(self, inner: fields.Field, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, str):
            try:
                value = parse_json(value)
            except (InvalidJsonError, UnsupportedJsonValueError) as exc:
                raise ValidationError(f"must be JSON: {exc.message}") from None
        return self.inner.deserialize(value)


class BatchWebhookSchema(Schema):
    url = fields.Url(required=True, schemes={"http", "https"}, require_tld=False)
    events = fields.List(fields.String(validate=validate.OneOf(BATCH_EVENTS)), validate=validate.Length(min=1))


class BatchParamsSchema(Schema):
    completion_window = fields.String(
        metadata={"description": "Seconds, or a number with s, m, h or d (e.g. 24h); "
                                 "default ROLLOUT_BATCH_COMPLETION_WINDOW"})
    metadata = JsonText(fields.Dict(keys=fields.String()), metadata={"description": "A JSON object"})
    webhook = JsonText(fields.Nested(BatchWebhookSchema),
                       metadata={"description": 'JSON: {"url": ..., "events": ["batch.completed", ...]}'})


class BatchLineSchema(Schema):
    custom_id = fields.String(required=True, validate=validate.Length(min=1, max=256))
    kind = fields.String(validate=validate.OneOf(JOB_KINDS))
    body = fields.Nested(JobRequestSchema, required=True)

    @pre_load
    def kind_overrides_body(self, data: Any, **_) -> Any:
        if isinstance(data, dict) and data.get("kind") in JOB_KINDS and isinstance(data.get("body"), dict):
            data = {**data, "body": {**data["body"], "kind": data["kind"]}}
        return data


class RequestCountsSchema(Schema):
    total = fields.Integer()
    completed = fields.Integer()
    failed = fields.Integer()


class LineErrorSchema(Schema):
    custom_id = fields.String(allow_none=True)
    line = fields.Integer()
    error = fields.Dict(metadata={"description": "{code, message, errors?}"})


class BatchErrorsSchema(Schema):
    invalid_lines = fields.Integer(metadata={"description": "Lines refused when the file was checked"})
    data = fields.List(fields.Nested(LineErrorSchema), metadata={"description": "The first of them"})


_TIME = "Unix time: seconds as a float in our view, whole seconds in OpenAI's"


def _timestamp(**kwargs) -> fields.Raw:
    return fields.Raw(metadata={"type": "number", "description": _TIME}, **kwargs)


class BatchSchema(Schema):
    """Our view of a batch or OpenAI's Batch object (``web.openai_batch_object``): the fields of
    both; each view fills its own."""

    id = fields.String()
    object = fields.Constant("batch")
    endpoint = fields.String(metadata={"description": "OpenAI view: the url of the batch's lines"})
    model = fields.String(metadata={"description": "OpenAI view: the served model"})
    input_file_id = fields.String(allow_none=True, metadata={"description": "OpenAI view"})
    output_file_id = fields.String(allow_none=True, metadata={"description": "OpenAI view: the results in "
                                                                             "OpenAI's line format (/v1/files)"})
    error_file_id = fields.String(allow_none=True, metadata={"description": "OpenAI view"})
    status = fields.String(metadata={"description": " | ".join(STATUSES)})
    request_counts = fields.Nested(RequestCountsSchema)
    created_at = _timestamp()
    in_progress_at = _timestamp(allow_none=True)
    finalizing_at = _timestamp(allow_none=True)
    completed_at = _timestamp(allow_none=True)
    failed_at = _timestamp(allow_none=True)
    cancelling_at = _timestamp(allow_none=True)
    cancelled_at = _timestamp(allow_none=True)
    expired_at = _timestamp(allow_none=True)
    expires_at = _timestamp()
    completion_window = fields.Raw(metadata={"description": "Seconds in our view; text (24h) in OpenAI's"})
    metadata = fields.Dict(allow_none=True)
    webhook = fields.Dict(allow_none=True)
    errors = fields.Raw(allow_none=True, metadata={
        "description": "Our view: {invalid_lines, data: [{custom_id, line, error}]}; OpenAI's: "
                       "{object: list, data: [{code, message, param, line}]} or null"})
    links = fields.Dict()


class ViewQuerySchema(Schema):
    view = fields.String(validate=validate.OneOf(VIEWS), metadata={
        "description": "openai: OpenAI's Batch object; native: ours. Default: OpenAI's for a batch made from "
                       "an input_file_id, ours otherwise"})


class BatchListQuerySchema(ListQuerySchema, ViewQuerySchema):
    status = fields.String(validate=validate.OneOf(STATUSES))
    limit = fields.Integer(strict=False, validate=validate.Range(1, 1000), load_default=20)
    after = fields.String(validate=validate.Length(1, 64),
                          metadata={"description": "OpenAI's cursor: the id of the last batch of the previous page"})


class BatchListSchema(Schema):
    object = fields.Constant("list")
    data = fields.List(fields.Nested(BatchSchema))
    first_id = fields.String(allow_none=True)
    last_id = fields.String(allow_none=True)
    has_more = fields.Boolean()
    next_cursor = fields.String(allow_none=True)


class FileBatchSchema(Schema):
    """OpenAI's batch create body (``openai.batches.create``), plus our optional webhook."""

    input_file_id = fields.String(required=True, validate=validate.Length(1, 64))
    endpoint = fields.String(required=True, validate=validate.OneOf(ENDPOINTS))
    completion_window = fields.String(metadata={"description": "24h, or seconds / a number with s, m, h or d"})
    metadata = fields.Dict(keys=fields.String(), allow_none=True)
    webhook = fields.Nested(BatchWebhookSchema)


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
        settings = svc.settings
        source: dict[str, str] = {}
        if request.mimetype == "application/json":
            data, options, endpoint = _read_file_batch(settings)
            source = {"api": "openai", "endpoint": endpoint, "input_file_id": options.pop("input_file_id")}
        else:
            data, params = _read_upload(settings.batch_max_bytes)
            options, endpoint = _load_params(params, settings), None
        parsed = validate_lines(data, max_lines=settings.batch_max_lines, endpoint=endpoint)
        if not parsed.valid:
            raise InvalidBatchError(
                "no valid line in the file" if parsed.total else "the file has no lines",
                errors=parsed.invalid[:REFUSED_LINE_ERRORS],
            )
        batch = batch_store(svc).get(create_batch(svc, current_owner(), parsed, source=source, **options)["id"])
        return batch_view(batch), 202, {"Location": f"/v1/batches/{batch['id']}"}

    @blp.arguments(BatchListQuerySchema, location="query", unknown="raise")
    @blp.response(200, BatchListSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(422, schema=None, description="Invalid query")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, query):
        """The caller's own batches, newest first (each in its view); ``cursor`` or OpenAI's ``after``."""
        store = batch_store(services())
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
    @blp.arguments(ViewQuerySchema, location="query", unknown="raise")
    @blp.response(200, BatchSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such batch for this key")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, _query, batch_id):
        """A batch, with its request counts."""
        return batch_view(batch_store(services()).get(batch_id, owner=current_owner()))


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
        store = batch_store(svc)
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
    store = batch_store(services())
    batch = store.get(batch_id, owner=current_owner())

    def pages():
        for page in store.iter_results(batch_id, which):
            yield b"\n".join(page) + b"\n"

    headers = {"Content-Disposition": f'attachment; filename="{batch_id}_{which}.jsonl"',
               "X-Batch-Status": batch["status"]}
    return Response(pages(), mimetype="application/jsonl", headers=headers)


# --- Reading and checking the file ----------------------------------------------------------------

def validate_lines(data: bytes, *, max_lines: int, endpoint: str | None = None) -> ParsedBatch:
    """Check every line (within a request context: limits come from the app's settings). Lines
    may be ours or OpenAI's; with an ``endpoint`` (OpenAI's batches) each line's url must be it,
    ours counting as ``/v1/jobs``."""
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    raw_lines = data.split(b"\n")
    counted = sum(1 for raw in raw_lines if raw.strip())
    if counted > max_lines:
        raise BatchTooLargeError(f"the file has {counted} lines; at most {max_lines} are accepted")
    schema = BatchLineSchema()
    parsed = ParsedBatch(total=counted)
    seen: set[str] = set()
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = parse_json(raw)
        except InvalidJsonError:
            parsed.invalid.append(_line_error(number, None, "invalid_json", "the line is not valid JSON"))
            continue
        except UnsupportedJsonValueError as exc:
            parsed.invalid.append(_line_error(number, None, exc.code, exc.message))
            continue
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        custom_id = custom_id if isinstance(custom_id, str) else None
        reply = None
        try:
            if is_openai_line(obj):
                custom_id, body, reply = read_line(obj, endpoint)
            else:
                check_endpoint(JOBS_URL, endpoint)
                line = schema.load(obj)
                custom_id, body = line["custom_id"], line["body"]
            body = check_limits(body)
        except LineShapeError as exc:  # never a request: no status (web.openai_batch_lines)
            parsed.invalid.append(_line_error(number, custom_id, exc.code, exc.message, errors=exc.errors))
            continue
        except ValidationError as exc:
            parsed.invalid.append(_line_error(number, custom_id, "invalid_request", _describe(exc.messages),
                                              errors=exc.messages, status_code=422))
            continue
        except RolloutError as exc:
            parsed.invalid.append(_line_error(number, custom_id, exc.code, exc.message, errors=exc.errors,
                                              status_code=exc.http_status))
            continue
        # Only a valid line claims its custom_id: a line fixed further down the file is not a duplicate.
        if custom_id in seen:
            parsed.invalid.append(_line_error(number, custom_id, "duplicate_custom_id",
                                              "custom_id is used by an earlier valid line"))
            continue
        seen.add(custom_id)
        stored = {"line": number, "custom_id": custom_id, "request": body}
        if reply is not None:
            stored["reply"] = reply
        parsed.valid.append(json.dumps(stored, separators=(",", ":")))
    return parsed


def _read_upload(limit: int) -> tuple[bytes, dict[str, str]]:
    """The file's bytes and the parameters (query string, plus form fields for multipart)."""
    params = request.args.to_dict()
    mimetype = request.mimetype
    try:
        if mimetype == "multipart/form-data":
            request.max_content_length = limit + MULTIPART_OVERHEAD
            upload = request.files.get("file")
            if upload is None:
                raise InvalidRequestError("multipart upload without a 'file' field",
                                          errors={"file": ["Missing data for required field."]})
            params.update(request.form.to_dict())
            data = upload.stream.read(limit + 1)
        elif mimetype in JSONL_TYPES:
            request.max_content_length = limit
            data = request.get_data(cache=False)
        else:
            raise UnsupportedMediaType(
                f"send the file as multipart/form-data (field 'file') or as {', '.join(JSONL_TYPES)}")
    except RequestEntityTooLarge:
        raise BatchTooLargeError(f"the file is larger than {limit} bytes") from None
    if len(data) > limit:
        raise BatchTooLargeError(f"the file is larger than {limit} bytes")
    return data, params


def _read_file_batch(settings) -> tuple[bytes, dict[str, Any], str]:
    """OpenAI's create body: the named file's bytes, the batch options, the endpoint."""
    try:
        body = FileBatchSchema().load(request.get_json(silent=False))
    except ValidationError as exc:
        raise InvalidRequestError(_describe(exc.messages), errors=exc.messages) from None
    files = file_store(services())
    record = files.get(body["input_file_id"], owner=current_owner())
    if record["purpose"] != "batch":
        raise InvalidRequestError(f"file {record['id']} has purpose {record['purpose']!r}; a batch reads files "
                                  "uploaded with purpose 'batch'", errors={"input_file_id": ["not a batch file"]})
    options = _check_options(settings, body.get("completion_window"), body.get("metadata"))
    options.update(webhook=body.get("webhook"), input_file_id=record["id"])
    return files.read(record["id"]), options, body["endpoint"]


def _load_params(params: dict[str, str], settings) -> dict[str, Any]:
    try:
        loaded = BatchParamsSchema().load(params)
    except ValidationError as exc:
        raise InvalidRequestError(_describe(exc.messages), errors=exc.messages) from None
    options = _check_options(settings, loaded.get("completion_window"), loaded.get("metadata"))
    options["webhook"] = loaded.get("webhook")
    return options


def _check_options(settings, window_text: str | None, metadata: dict | None) -> dict[str, Any]:
    window = settings.batch_completion_window if window_text is None else _parse_window(window_text)
    if metadata is not None and len(json.dumps(metadata)) > settings.max_metadata_bytes:
        raise InvalidRequestError(f"metadata must be at most {settings.max_metadata_bytes} bytes as JSON",
                                  errors={"metadata": ["too large"]})
    return {"completion_window": window, "metadata": metadata}


def _parse_window(text: str) -> int:
    match = _WINDOW.match(text)
    seconds = int(match.group(1)) * _UNITS[match.group(2)] if match else -1
    if not MIN_COMPLETION_WINDOW <= seconds <= MAX_COMPLETION_WINDOW:
        raise InvalidRequestError(
            f"completion_window must be between {MIN_COMPLETION_WINDOW} s and {MAX_COMPLETION_WINDOW // 3600} h "
            "(seconds, or a number with s, m, h or d)", errors={"completion_window": ["invalid"]})
    return seconds


def _line_error(number: int, custom_id: str | None, code: str, message: str, errors: Any = None,
                status_code: int | None = None) -> dict[str, Any]:
    """An invalid line's error entry; ``status_code``: what its route would have answered, for a
    line that is a request (OpenAI's results write it as a response, the others as an error)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if errors is not None:
        error["errors"] = errors
    entry: dict[str, Any] = {"custom_id": custom_id, "line": number, "error": error}
    if status_code is not None:
        entry["status_code"] = status_code
    return entry


def _describe(messages: Any) -> str:
    """'body.token_ids: Missing data for required field.' for the first few invalid fields."""
    flat: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list) and node and all(isinstance(item, str) for item in node):
            flat.append(f"{path or 'line'}: {node[0]}")
        elif isinstance(node, list):
            for item in node:
                walk(item, path)
        else:
            flat.append(f"{path or 'line'}: {node}")

    walk(messages, "")
    shown = "; ".join(flat[:3])
    return shown + (f" (and {len(flat) - 3} more)" if len(flat) > 3 else "")
