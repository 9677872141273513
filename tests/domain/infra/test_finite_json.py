"""What the service writes to Redis reads back as the value it wrote, whichever encoder wrote it
(domain/infra/finite_json.py: orjson, json for what orjson refuses), and never as JSON a strict
parser refuses."""

from __future__ import annotations

import json
import math

import pytest

from domain.infra import finite_json

VALUES = [
    {"choices": [{"token_ids": [1, 2, 3], "logprobs": [-0.5, -1e-7, -123.456789012345678]}], "text": "naïve 東京 🎲"},
    {"metadata": {"step": 2**70 + 1}},  # past 64 bits: orjson refuses it
    {1: "a key that is not a string"},  # json writes it as "1"; orjson refuses it
    {"text": "\ud800"},  # a lone surrogate: orjson refuses it
    [0.1, -0.0, 1e16, 5e-324, 1.7976931348623157e308],
]


@pytest.mark.parametrize("value", VALUES)
def test_compact_reads_back_as_json_dumps_would_have_written_it(value):
    written = finite_json.compact(value)
    assert json.loads(written) == json.loads(json.dumps(value, separators=(",", ":")))


def test_non_finite_floats_are_written_as_null():
    written = finite_json.compact({"logprobs": [float("nan"), -math.inf, -1.0], "x": math.inf})
    assert json.loads(written) == {"logprobs": [None, None, -1.0], "x": None}
    assert "NaN" not in written and "Infinity" not in written
