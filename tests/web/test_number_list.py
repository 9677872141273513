"""``NumberList`` (web/api/schemas.py) writes a response's numbers as marshmallow's own ``fields.List``
writes them, for every such field our schemas declare (found by walking them, so a field added later
is covered)."""

from __future__ import annotations

import marshmallow
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.web.test_schema_base import OUR_SCHEMAS
from web.api.schemas import NumberList

NUMBER_LISTS = [(f"{cls.__qualname__}.{name}", field) for cls in OUR_SCHEMAS
                for name, field in cls().dump_fields.items() if isinstance(field, NumberList)]
NUMBERS = st.lists(st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                             st.floats(allow_nan=False, allow_infinity=False)), max_size=8)


def test_the_response_schemas_hold_number_lists():
    assert {"ChoiceSchema.token_ids", "ChoiceSchema.logprobs", "ResultSchema.prompt_token_ids",
            "GenerateReplySchema.output_ids"} <= {name for name, _ in NUMBER_LISTS}


@pytest.mark.parametrize(("name", "field"), NUMBER_LISTS, ids=[name for name, _ in NUMBER_LISTS])
@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.none(), NUMBERS))
def test_a_number_list_dumps_as_marshmallows_list(name, field, value):
    stock = marshmallow.fields.List(field.inner)
    ours, theirs = field.serialize("v", {"v": value}), stock.serialize("v", {"v": value})
    assert ours == theirs and [type(item) for item in ours or []] == [type(item) for item in theirs or []]


def test_a_number_list_refuses_what_it_would_not_write_alike():
    with pytest.raises(TypeError):
        NumberList(marshmallow.fields.String())
    with pytest.raises(TypeError):
        NumberList(marshmallow.fields.Integer(as_string=True))
