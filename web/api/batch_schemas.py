"""The schemas of /v1/batches: a batch line, the upload's parameters, the batch (both views) and
its lists."""

from __future__ import annotations

from typing import Any

from marshmallow import ValidationError, fields, pre_load, validate

from domain.batches.statuses import STATUSES
from domain.webhooks import BATCH_EVENTS
from web.api.long_poll import wait_field
from web.api.schemas import JOB_KINDS, JobRequestSchema, ListQuerySchema
from web.dialects.openai.batch_lines import ENDPOINTS
from web.dialects.openai.batch_object import VIEWS
from web.schema_base import Schema
from web.serving.json_body import InvalidJsonError, UnsupportedJsonValueError, parse_json


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


_TIME = "Unix time: seconds as a float in our view, whole seconds in OpenAI's"


def _timestamp(**kwargs) -> fields.Raw:
    return fields.Raw(metadata={"type": "number", "description": _TIME}, **kwargs)


class BatchSchema(Schema):
    """Our view of a batch or OpenAI's Batch object (``web.dialects.openai.batch_object``): the fields of
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


class BatchPollQuerySchema(ViewQuerySchema):
    wait = wait_field("the batch")


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


