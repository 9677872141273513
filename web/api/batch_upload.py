"""Reading a batch upload: the request body (multipart, JSONL, or a file named by id), its
parameters and completion window, and each line checked into valid lines and line errors."""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flask import request
from marshmallow import ValidationError
from werkzeug.exceptions import RequestEntityTooLarge, UnsupportedMediaType

from domain.batches.creation import BatchTooLargeError, ParsedBatch
from domain.error_statuses import http_status
from domain.infra import finite_json
from engine.errors import InvalidRequestError, RolloutError
from engine.request_rules import check_metadata
from web.api.batch_schemas import BatchLineSchema, BatchParamsSchema, FileBatchSchema
from web.api.submit import check_limits
from web.auth import current_owner
from web.dialects.common import tokenizer
from web.dialects.openai.batch_lines import (
    JOBS_URL,
    LineShapeError,
    PendingLine,
    begin_line,
    chat_token_ids,
    check_endpoint,
    finish_line,
    is_openai_line,
)
from web.services import services
from web.serving.json_body import InvalidJsonError, UnsupportedJsonValueError, parse_json

JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "text/plain")
# Inputs and results of a running batch sit in Redis for its whole window: a week bounds that.
MAX_COMPLETION_WINDOW = 7 * 24 * 3600
MIN_COMPLETION_WINDOW = 60
# Line errors shown in a 422 (the batch object shows domain.batches.creation.REPORTED_LINE_ERRORS).
REFUSED_LINE_ERRORS = 5
# Room for the multipart boundaries and the form fields around the file.
MULTIPART_OVERHEAD = 64 * 1024
# At most 9 digits: past that the window is out of range anyway, and int() of thousands of digits raises.
_WINDOW = re.compile(r"^\s*(\d{1,9})\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
# Lines are checked a chunk at a time: one tokenizer call per chunk's chat lines, and what the
# steps hold in between (rendered prompts, token ids) bounded by the chunk, not the file.
LINES_PER_CHUNK = 256
_NATIVE_LINE = BatchLineSchema()


class InvalidBatchError(InvalidRequestError):
    """The file has no valid line (or none at all); ``errors`` lists the first line errors."""

    code = "invalid_batch"


# --- Schemas --------------------------------------------------------------------------------------

def check_lines(data: bytes, *, max_lines: int, endpoint: str | None = None) -> tuple[int, Iterator[ParsedBatch]]:
    """The file's line count, and its lines checked a block at a time (within a request context:
    limits come from the app's settings); too many lines raise before any is checked. Lines may be
    ours or OpenAI's; with an ``endpoint`` (OpenAI's batches) each line's url must be it, ours
    counting as ``/v1/jobs``."""
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    numbered = [(number, raw) for number, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
    if len(numbered) > max_lines:
        raise BatchTooLargeError(f"the file has {len(numbered)} lines; at most {max_lines} are accepted")
    return len(numbered), _checked_blocks(numbered, endpoint)


def validate_lines(data: bytes, *, max_lines: int, endpoint: str | None = None) -> ParsedBatch:
    """Every line checked, as one :class:`ParsedBatch` (see :func:`check_lines`)."""
    total, blocks = check_lines(data, max_lines=max_lines, endpoint=endpoint)
    parsed = ParsedBatch(total=total)
    for block in blocks:
        parsed.valid += block.valid
        parsed.invalid += block.invalid
        parsed.scoring += block.scoring
    return parsed


def _checked_blocks(numbered: list[tuple[int, bytes]], endpoint: str | None) -> Iterator[ParsedBatch]:
    seen: set[str] = set()
    for lines in _read_lines(numbered, endpoint):
        block = ParsedBatch(total=len(lines))
        for line in lines:
            if line.error is not None:
                block.invalid.append(line.error)
            # Only a valid line claims its custom_id: a line fixed further down the file is not a duplicate.
            elif line.custom_id in seen:
                block.invalid.append(_line_error(line.number, line.custom_id, "duplicate_custom_id",
                                                 "custom_id is used by an earlier valid line"))
            else:
                seen.add(line.custom_id)
                block.valid.append(line.stored())
                block.scoring.append(line.body.get("kind") == "score")
        yield block


@dataclass
class _Line:
    """One line of the file as it is checked: an error entry, or its job request (and reply)."""

    number: int
    custom_id: str | None = None
    error: dict[str, Any] | None = None
    pending: PendingLine | None = None  # an OpenAI line read up to its token ids
    body: dict[str, Any] | None = None
    reply: dict[str, Any] | None = None

    def stored(self) -> str:
        stored = {"line": self.number, "custom_id": self.custom_id, "request": self.body}
        if self.reply is not None:
            stored["reply"] = self.reply
        return finite_json.compact(stored)  # orjson: 4 against 71 µs for a chat line's 564 ids


def _read_lines(numbered: list[tuple[int, bytes]], endpoint: str | None) -> Iterator[list[_Line]]:
    """Every line checked, in order, a chunk at a time; a line's error is its own. Chat lines are
    read in two steps around one tokenizer call for their chunk
    (web.dialects.openai.batch_lines.chat_token_ids). That call runs in a thread while this one begins the
    next chunk and finishes the last: the Rust tokenizer lets go of the GIL, and on chat lines it
    takes about a third of the time, so the two overlap (bench/batch_submit.py ``--overlap``)."""
    with ThreadPoolExecutor(1, thread_name_prefix="batch-tokenizer") as tokenizing:
        previous = None
        for start in range(0, len(numbered), LINES_PER_CHUNK):
            lines = [_begin(number, raw, endpoint) for number, raw in numbered[start:start + LINES_PER_CHUNK]]
            pending = [line for line in lines if line.pending is not None]
            # The tokenizer is fetched here, in the request's context, and only for a chunk with chat lines.
            chats = any(line.pending.prompt is not None for line in pending)
            tokenized = tokenizing.submit(chat_token_ids, [line.pending for line in pending],
                                          tokenizer() if chats else None)
            if previous is not None:
                yield _finish(*previous)
            previous = lines, pending, tokenized
        if previous is not None:
            yield _finish(*previous)


def _finish(lines: list[_Line], pending: list[_Line], tokenized: Future) -> list[_Line]:
    for line, token_ids in zip(pending, tokenized.result(), strict=True):
        with _refusals(line):
            line.custom_id, body, line.reply = finish_line(line.pending, token_ids)
            # Chat and completions lines were built by the dialect's native_request, which checked their ids.
            line.body = check_limits(body, vocabulary_checked=line.pending.url != JOBS_URL)
    return lines


def _begin(number: int, raw: bytes, endpoint: str | None) -> _Line:
    line = _Line(number)
    try:
        obj = parse_json(raw)
    except InvalidJsonError:
        line.error = _line_error(number, None, "invalid_json", "the line is not valid JSON")
        return line
    except UnsupportedJsonValueError as exc:
        line.error = _line_error(number, None, exc.code, exc.message)
        return line
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    line.custom_id = custom_id if isinstance(custom_id, str) else None
    with _refusals(line):
        if is_openai_line(obj):
            line.pending = begin_line(obj, endpoint)
        else:
            check_endpoint(JOBS_URL, endpoint)
            loaded = _NATIVE_LINE.load(obj)
            line.custom_id, line.body = loaded["custom_id"], check_limits(loaded["body"])
    return line


@contextmanager
def _refusals(line: _Line) -> Iterator[None]:
    """A refused line's error entry: a line that is no request has no status (web.dialects.openai.batch_lines),
    a refused request the status its route would have answered."""
    try:
        yield
    except LineShapeError as exc:
        line.error = _line_error(line.number, line.custom_id, exc.code, exc.message, errors=exc.errors)
    except ValidationError as exc:
        line.error = _line_error(line.number, line.custom_id, "invalid_request", _describe(exc.messages),
                                 errors=exc.messages, status_code=422)
    except RolloutError as exc:
        line.error = _line_error(line.number, line.custom_id, exc.code, exc.message, errors=exc.errors,
                                 status_code=http_status(exc))


def read_upload(limit: int) -> tuple[bytes, dict[str, str]]:
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


def read_file_batch(settings) -> tuple[bytes, dict[str, Any], str]:
    """OpenAI's create body: the named file's bytes, the batch options, the endpoint."""
    try:
        body = FileBatchSchema().load(request.get_json(silent=False))
    except ValidationError as exc:
        raise InvalidRequestError(_describe(exc.messages), errors=exc.messages) from None
    files = services().files
    record = files.get(body["input_file_id"], owner=current_owner())
    if record["purpose"] != "batch":
        raise InvalidRequestError(f"file {record['id']} has purpose {record['purpose']!r}; a batch reads files "
                                  "uploaded with purpose 'batch'", errors={"input_file_id": ["not a batch file"]})
    options = _check_options(settings, body.get("completion_window"), body.get("metadata"))
    options.update(webhook=body.get("webhook"), input_file_id=record["id"])
    return files.read(record["id"]), options, body["endpoint"]


def load_params(params: dict[str, str], settings) -> dict[str, Any]:
    try:
        loaded = BatchParamsSchema().load(params)
    except ValidationError as exc:
        raise InvalidRequestError(_describe(exc.messages), errors=exc.messages) from None
    options = _check_options(settings, loaded.get("completion_window"), loaded.get("metadata"))
    options["webhook"] = loaded.get("webhook")
    return options


def _check_options(settings, window_text: str | None, metadata: dict | None) -> dict[str, Any]:
    window = settings.batch_completion_window if window_text is None else _parse_window(window_text)
    check_metadata(metadata, services().limits.max_metadata_bytes)
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
