"""Every schema of the service loads exactly what marshmallow's own path loads (web/schema_base.py).

The contract enumerates every marshmallow schema our packages define, so a schema added later is
covered without editing this file. The reference is marshmallow's ``Schema._deserialize`` itself,
swapped back in for the second load; results must be equal with their keys in the same order,
errors equal as dicts (their order may differ: present fields first).
"""

from __future__ import annotations

from typing import Any
from unittest.mock import patch

import marshmallow
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import web.app  # noqa: F401 - imports every route module, and so every schema
from web import schema_base

PACKAGES = ("web.", "workers.", "client.", "engine.", "processors.")


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _subclasses(sub)
    return found


OUR_SCHEMAS = sorted((cls for cls in _subclasses(marshmallow.Schema)
                      if cls.__module__.startswith(PACKAGES) and cls is not schema_base.Schema),
                     key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")

# Values chosen to be valid for some field and wrong for most: each key drawn gets one of them.
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70_000), st.floats(-3, 3, allow_nan=False),
    st.text(max_size=4),
    st.sampled_from(["generate", "score", "user", "assistant", "POST", "/v1/jobs", "/v1/chat/completions",
                     "image_url", "http://example.test/a.png", "demo", "stop", "auto", "1h", "float32"]),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(st.integers(0, 700), max_size=4),
    st.lists(SCALARS, max_size=2),
    st.dictionaries(st.sampled_from(["max_tokens", "temperature", "role", "content", "url", "type", "seed", "n"]),
                    SCALARS, max_size=3),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=4)}),
             min_size=1, max_size=2),
)


def _data_keys(schema: marshmallow.Schema) -> list[str]:
    return [field.data_key or name for name, field in schema.load_fields.items()]


def _load(schema_class: type, data: Any) -> tuple[str, Any]:
    try:
        return "loaded", _ordered(schema_class().load(data))
    except marshmallow.ValidationError as error:
        return "invalid", error.messages
    except Exception as error:  # noqa: BLE001 - a hook that fails on odd input must fail the same way
        return "raised", type(error).__name__


def _ordered(value: Any) -> Any:
    """``value`` with every dict as its list of items, so key order is compared too."""
    if isinstance(value, dict):
        return [(key, _ordered(item)) for key, item in value.items()]
    if isinstance(value, list | tuple):
        return [_ordered(item) for item in value]
    return value


def _stock_load(schema_class: type, data: Any) -> tuple[str, Any]:
    with patch.object(schema_base.Schema, "_deserialize", marshmallow.Schema._deserialize):
        return _load(schema_class, data)


def test_every_schema_of_ours_takes_the_base():
    assert len(OUR_SCHEMAS) > 40
    direct = [cls.__qualname__ for cls in OUR_SCHEMAS if not issubclass(cls, schema_base.Schema)]
    assert not direct, f"derive these from web.schema_base.Schema: {direct}"


@pytest.mark.parametrize("schema_class", OUR_SCHEMAS, ids=lambda cls: cls.__qualname__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draw=st.data())
def test_a_load_is_marshmallows_own(schema_class, draw):
    keys = _data_keys(schema_class())
    data = draw.draw(st.dictionaries(st.sampled_from([*keys, "not_a_field"]), VALUES, max_size=min(6, len(keys) + 1)))
    assert _load(schema_class, data) == _stock_load(schema_class, data)


REQUESTS = [
    ("web.api.schemas", "JobRequestSchema", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "seed": 1}}),
    ("web.api.schemas", "JobRequestSchema", {"kind": "score", "token_ids": [1], "completion_token_ids": [2, 3]}),
    ("web.api.schemas", "JobRequestSchema", {"token_ids": [], "sampling_params": {"top_p": 0}, "extra": 1}),
    ("web.dialects.openai", "ChatCompletionRequestSchema",
     {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True}),
    ("web.dialects.openai", "ChatCompletionRequestSchema", {"messages": "not a list", "n": 0}),
    ("web.dialects.openai", "CompletionRequestSchema", {"model": "demo", "prompt": [1, 2], "echo": True}),
    ("web.api.batch_schemas", "RequestCountsSchema", {"failed": 1, "completed": 2, "total": 3}),  # every field sent
]


@pytest.mark.parametrize(("module", "name", "data"), REQUESTS)
def test_the_requests_of_each_route_load_as_marshmallow_loads_them(module, name, data):
    schema_class = getattr(__import__(module, fromlist=[name]), name)
    assert _load(schema_class, data) == _stock_load(schema_class, data)


def test_a_narrowed_copy_is_kept_per_set_of_fields_sent_and_their_number_is_bounded():
    from web.api.schemas import SamplingParamsSchema

    schema = SamplingParamsSchema()
    schema.load({"max_tokens": 3})
    kept = dict(schema._load_plan.narrowed)
    schema.load({"max_tokens": 5})
    assert schema._load_plan.narrowed == kept and frozenset({"max_tokens"}) in kept
    knobs = ["temperature", "top_p", "min_p", "seed", "n", "ignore_eos", "logprobs", "min_tokens"]
    for mask in range(1, 2 ** len(knobs)):
        sent = {knob: schema.load({})[knob] for bit, knob in enumerate(knobs) if mask >> bit & 1}
        schema.load({**sent, "max_tokens": 3})
    assert len(schema._load_plan.narrowed) <= schema_base.MAX_NARROWED


def test_a_schema_built_per_request_shares_the_narrowed_copies_of_its_class():
    from web.api.schemas import JobRequestSchema

    first, second = JobRequestSchema(), JobRequestSchema()
    first.load({"token_ids": [1]})
    second.load({"token_ids": [2]})
    assert first._load_plan is second._load_plan
    lenient = JobRequestSchema(unknown=marshmallow.EXCLUDE)  # other options: a plan of its own
    assert lenient.load({"token_ids": [1], "x": 1}) == first.load({"token_ids": [1]})
    assert lenient._load_plan is not first._load_plan
