"""The batch as OpenAI's Batch object, beside our own view (``domain.batches.store.public_batch``).

Which view a call gets: the OpenAI object for a batch made the OpenAI way (``POST /v1/batches``
with a JSON body naming an ``input_file_id``), our view for one uploaded as a file (multipart or
JSONL body), which today's clients and the CLI read; ``?view=openai`` or ``?view=native`` asks for
either on any batch. Both carry ``id``, ``object``, ``status`` and ``request_counts`` alike, so a
progress bar follows either. Fields follow OpenAI's Batch object (``openai.types.Batch``): integer
Unix timestamps, ``completion_window`` as text, ``errors`` as ``{object: "list", data: [{code,
message, param, line}]}`` (here: the first invalid lines, which did not fail the batch).
"""

from __future__ import annotations

from typing import Any

from flask import request

from domain.batches.statuses import STATUS_TIMESTAMPS
from domain.batches.store import public_batch
from web.dialects.common import served_model_name
from web.dialects.openai.batch_lines import JOBS_URL

VIEWS = ("openai", "native")


def wants_openai(batch: dict[str, Any]) -> bool:
    view = request.args.get("view")
    return view == "openai" if view in VIEWS else batch.get("api") == "openai"


def batch_view(batch: dict[str, Any]) -> dict[str, Any]:
    """The view this call gets of ``batch`` (a stored record)."""
    return openai_batch(batch) if wants_openai(batch) else public_batch(batch)


def openai_batch(batch: dict[str, Any]) -> dict[str, Any]:
    errors = [{"code": entry["error"]["code"], "message": entry["error"]["message"], "line": entry["line"],
               "param": _param(entry["error"].get("errors"))} for entry in batch.get("validation_errors") or []]
    view: dict[str, Any] = {
        "id": batch["id"],
        "object": "batch",
        "endpoint": batch.get("endpoint") or JOBS_URL,
        "model": served_model_name(),
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": batch.get("input_file_id"),
        "completion_window": window_text(batch["completion_window"]),
        "status": batch["status"],
        "output_file_id": batch.get("output_file_id"),
        "error_file_id": batch.get("error_file_id"),
        "created_at": int(batch["created_at"]),
    }
    for field in STATUS_TIMESTAMPS.values():
        view[field] = None if batch.get(field) is None else int(batch[field])
    view["expires_at"] = int(batch["expires_at"])
    view["request_counts"] = {"total": batch["total"], "completed": batch["completed"], "failed": batch["failed"]}
    view["metadata"] = batch.get("metadata")
    return view


def window_text(seconds: int) -> str:
    """``24h`` for 86400 s: OpenAI writes the window as it was asked for."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _param(errors: Any) -> str | None:
    """The first field a line error names, as a dotted path (``body.messages``)."""
    path: list[str] = []
    while isinstance(errors, dict) and errors:
        key = next(iter(errors))
        path.append(str(key))
        errors = errors[key]
    return ".".join(path) or None
