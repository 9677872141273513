"""/v1/files: OpenAI's Files API for batch input and results, with errors in OpenAI's shape.

Upload a JSONL file with ``purpose=batch`` (what ``openai.files.create`` sends), then name it in
``POST /v1/batches`` (``input_file_id``). A batch's results are files too (purpose
``batch_output``, its ``output_file_id`` / ``error_file_id``), rendered in OpenAI's line format on
download (``web.dialects.openai.batch_lines``). A file belongs to the key that uploaded it (or ran its
batch): any other key gets 404. Uploads take the batch size cap (``ROLLOUT_BATCH_MAX_BYTES``) and
count against the key's stored-input cap with its unfinished batches
(``ROLLOUT_BATCH_MAX_STORED_BYTES_PER_KEY``); files expire ``ROLLOUT_RESULT_TTL`` after they are made.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Any

from flask import Response, request, stream_with_context
from flask.views import MethodView
from marshmallow import fields, validate
from werkzeug.exceptions import RequestEntityTooLarge

from domain.batches.creation import BatchTooLargeError
from domain.batches.files import PURPOSES
from engine.errors import InvalidRequestError, NotFoundError
from web.api.attachment import attachment
from web.api.batch_upload import MULTIPART_OVERHEAD
from web.auth import current_owner
from web.blueprint import Blueprint
from web.dialects.errors import install, openai_shape
from web.dialects.openai.batch_lines import render_results
from web.schema_base import Schema
from web.services import services

blp = Blueprint("files", __name__, url_prefix="/v1/files", description="Files for batches (OpenAI's Files API)")
install(blp, openai_shape)

_UPLOAD_DOC = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary", "description": "The JSONL file"},
        "purpose": {"type": "string", "enum": ["batch"]}}}}}}


class FileSchema(Schema):
    id = fields.String()
    object = fields.Constant("file")
    bytes = fields.Integer()
    created_at = fields.Integer()
    expires_at = fields.Integer()
    filename = fields.String()
    purpose = fields.String(metadata={"description": " | ".join(PURPOSES)})
    status = fields.String()
    status_details = fields.String(allow_none=True)


class FileListQuerySchema(Schema):
    after = fields.String(validate=validate.Length(1, 64), metadata={"description": "The last file id seen"})
    limit = fields.Integer(strict=False, validate=validate.Range(1, 10_000), load_default=100)
    order = fields.String(validate=validate.OneOf(["asc", "desc"]), load_default="desc",
                          metadata={"description": "By creation time: desc (newest first) or asc"})
    purpose = fields.String(validate=validate.OneOf(PURPOSES))


class FileListSchema(Schema):
    object = fields.Constant("list")
    data = fields.List(fields.Nested(FileSchema))
    first_id = fields.String(allow_none=True)
    last_id = fields.String(allow_none=True)
    has_more = fields.Boolean()


class FileDeletedSchema(Schema):
    id = fields.String()
    object = fields.Constant("file")
    deleted = fields.Boolean()


def _errors(view):
    for status, text in ((401, "Missing or invalid API key"), (503, "Store unavailable")):
        view = blp.alt_response(status, schema=None, description=text)(view)
    return view


@blp.route("")
class Files(MethodView):
    @blp.doc(requestBody=_UPLOAD_DOC)
    @blp.response(200, FileSchema)
    @blp.alt_response(413, schema=None, description="Larger than ROLLOUT_BATCH_MAX_BYTES")
    @blp.alt_response(422, schema=None, description="No file, or a purpose other than batch")
    @blp.alt_response(429, schema=None, description="The key's files and unfinished batches hold "
                                                    "ROLLOUT_BATCH_MAX_STORED_BYTES_PER_KEY")
    @blp.alt_response(503, schema=None, description="Redis at its memory high-water mark (redis_memory_full)")
    @_errors
    def post(self):
        """Upload a JSONL file for a batch (purpose ``batch``)."""
        svc = services()
        svc.redis_memory.admit()  # 503 redis_memory_full at Redis' high-water mark, before reading the file
        limit = svc.settings.batch_max_bytes
        request.max_content_length = limit + MULTIPART_OVERHEAD
        try:
            if request.mimetype != "multipart/form-data":
                raise InvalidRequestError("send the file as multipart/form-data (fields 'file' and 'purpose')",
                                          errors={"file": ["Missing data for required field."]})
            upload = request.files.get("file")
            purpose = request.form.get("purpose")
        except RequestEntityTooLarge:
            raise BatchTooLargeError(f"the file is larger than {limit} bytes") from None
        if upload is None:
            raise InvalidRequestError("multipart upload without a 'file' field",
                                      errors={"file": ["Missing data for required field."]})
        if purpose != "batch":
            raise InvalidRequestError("purpose must be 'batch': files here are batch input",
                                      errors={"purpose": ["must be 'batch'"]})
        stream = upload.stream
        size = _size(stream)
        if size > limit:
            raise BatchTooLargeError(f"the file is larger than {limit} bytes")
        filename = os.path.basename(upload.filename or "") or "input.jsonl"
        return public_file(svc.files.upload(owner=current_owner(), filename=filename[:255], purpose=purpose,
                                            stream=stream, size=size, cap=svc.settings.batch_max_stored_bytes_per_key))

    @blp.arguments(FileListQuerySchema, location="query", unknown="raise")
    @blp.response(200, FileListSchema)
    @blp.alt_response(404, schema=None, description="after names no file of this key")
    @blp.alt_response(422, schema=None, description="Invalid query")
    @_errors
    def get(self, query):
        """The caller's files, newest first (or oldest first with ``order=asc``)."""
        files = services().files
        owner = current_owner()
        cursor = None
        if "after" in query:
            cursor = repr(files.get(query["after"], owner=owner)["created_at"])
        found, cursor = files.list(owner=owner, purpose=query.get("purpose"), limit=query["limit"], cursor=cursor,
                                   newest_first=query["order"] == "desc")
        data = [public_file(_sized(record)) for record in found]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": cursor is not None}


@blp.route("/<string:file_id>")
class File(MethodView):
    @blp.response(200, FileSchema)
    @blp.alt_response(404, schema=None, description="No such file for this key")
    @_errors
    def get(self, file_id):
        """A file's record."""
        return public_file(_sized(services().files.get(file_id, owner=current_owner())))

    @blp.response(200, FileDeletedSchema)
    @blp.alt_response(404, schema=None, description="No such file for this key")
    @_errors
    def delete(self, file_id):
        """Delete a file (a batch already made from it keeps running: it holds its own copy of the lines)."""
        files = services().files
        files.delete(files.get(file_id, owner=current_owner()))
        return {"id": file_id, "object": "file", "deleted": True}


@blp.route("/<string:file_id>/content")
class FileContent(MethodView):
    @blp.doc(responses={"200": {"description": "The file's bytes (results: one OpenAI output line per request)",
                                "content": {"application/jsonl": {"schema": {"type": "string"}}}}})
    @blp.alt_response(404, schema=None, description="No such file for this key")
    @_errors
    def get(self, file_id):
        """The file's content, streamed."""
        record = services().files.get(file_id, owner=current_owner())
        headers = {"Content-Disposition": attachment(record["filename"])}
        # Rendering results needs the app (the tokenizer) while the response streams.
        return Response(stream_with_context(_content(record)), mimetype="application/jsonl", headers=headers)


def public_file(record: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's File object (``openai.types.FileObject``)."""
    return {"id": record["id"], "object": "file", "bytes": record.get("bytes") or 0,
            "created_at": int(record["created_at"]), "expires_at": int(record["expires_at"]),
            "filename": record["filename"], "purpose": record["purpose"], "status": "processed",
            "status_details": None}


def _content(record: dict[str, Any]) -> Iterator[bytes]:
    if record.get("batch_id"):
        return _results(record)
    files = services().files
    if not files.has_data(record["id"]):  # 404 now, not a cut stream later
        raise NotFoundError(f"no file {record['id']!r}")
    return files.iter_chunks(record["id"], record["bytes"])


def _results(record: dict[str, Any]) -> Iterator[bytes]:
    """A results file: the batch's results, rendered in OpenAI's line format."""
    store = services().batches
    try:
        batch = store.get(record["batch_id"])
    except NotFoundError:
        raise NotFoundError(f"no file {record['id']!r}") from None
    created = int(batch.get("finalizing_at") or batch.get("cancelling_at") or batch["created_at"])
    return render_results(store.iter_results(batch["id"], record["results"]), batch_id=batch["id"], created=created)


def _sized(record: dict[str, Any]) -> dict[str, Any]:
    """A results file learns its size the first time it is asked for (rendering it once)."""
    if record.get("bytes") is None and record.get("batch_id"):
        try:
            size = sum(len(part) for part in _results(record))
        except NotFoundError:
            return record
        services().files.set_size(record["id"], size)
        record = {**record, "bytes": size}
    return record


def _size(stream: io.IOBase) -> int:
    """The uploaded file's size: werkzeug has spooled it (memory or a temporary file), so seek."""
    stream.seek(0, io.SEEK_END)
    size = stream.tell()
    stream.seek(0)
    return size
