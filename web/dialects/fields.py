"""marshmallow fields for the unions dialect bodies use (one value or a batch of them)."""

from __future__ import annotations

from typing import Any

from marshmallow import ValidationError, fields, pre_load, validate

from web.api.schemas import StrictBoolean, TokenIds
from web.schema_base import Schema


class OneOrMany(fields.Field):
    """``inner``'s value, or a list of them (a batch). Deserializes to what was sent, checked."""

    def __init__(self, inner: fields.Field, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, list) and not isinstance(self.inner, fields.List):
            return [self.inner.deserialize(item, attr, data) for item in value]
        return self.inner.deserialize(value, attr, data)


class TokenIdsOrBatch(fields.Field):
    """A list of token ids, or a list of such lists (a batch)."""

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, list) and value and all(isinstance(item, list) for item in value):
            return [TokenIds().deserialize(item, attr, data) for item in value]
        return TokenIds().deserialize(value, attr, data)


class NullMeansDefault(Schema):
    """A body where ``null`` for an optional field means its default (SGLang's dataclasses and
    vLLM's / OpenAI's pydantic models read it that way): nulls are dropped before loading."""

    @pre_load
    def drop_nulls(self, data: Any, **_) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


def refuse_non_default(body: dict[str, Any], defaults: dict[str, tuple], where: str = "") -> None:
    """Knobs this service cannot honour are accepted only at their default values: anything else is a 422
    naming the knob, never silently dropped."""
    bad = {f"{where}{name}": [f"not supported here; leave it out or send {allowed[0]!r}"]
           for name, allowed in defaults.items() if name in body and body[name] not in allowed}
    if bad:
        raise ValidationError(bad)


class StreamOptionsSchema(Schema):
    """OpenAI's ``stream_options``: ``include_usage`` is honoured (a last chunk with the usage);
    vLLM's ``continuous_usage_stats`` only off; any other key is a 422 (marshmallow refuses unknown
    fields), never dropped."""

    include_usage = StrictBoolean(allow_none=True)
    continuous_usage_stats = StrictBoolean(allow_none=True, validate=validate.OneOf(
        [False], error="not supported here: usage comes in the last chunk (include_usage)"))
