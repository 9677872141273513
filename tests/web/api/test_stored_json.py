"""web/api/stored_json.py: a result stored by orjson, sent in the spelling the streams always used
(``json.dumps``: ASCII only, Python's float repr), the same bytes, without decoding it."""

from __future__ import annotations

import json
import struct

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling_mask import SamplingMasks
from web.api.stored_json import respelled, stored_pieces

# Strings that look like the numbers rewritten outside them, quotes, escapes, DEL, past ASCII.
TEXT = st.one_of(st.text(alphabet='0.e-5"\\\x7f\x1f é😀\u2028', max_size=8), st.text(max_size=8))
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.floats(allow_nan=False, allow_infinity=False, width=32),
                   st.integers(-330, 308).map(lambda e: float(f"1.5e{e}")),
                   st.floats(min_value=-1e-3, max_value=1e-3).map(lambda x: struct.unpack("f", struct.pack("f", x))[0]))
VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), FLOATS, TEXT),
                      lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(TEXT, inner, max_size=4)),
                      max_leaves=40)


def legacy(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


@settings(max_examples=500, deadline=None)
@given(value=VALUES, piece=st.sampled_from([1, 7, 64 * 1024]))
def test_orjsons_bytes_come_out_as_json_dumps_writes_the_value(value, piece):
    parts = list(respelled(orjson.dumps(value), piece))
    assert b"".join(parts) == legacy(value)
    assert all(0 < len(part) <= piece for part in parts)


@settings(max_examples=200, deadline=None)
@given(value=VALUES)
def test_bytes_spelled_as_json_dumps_pass_through(value):
    """A field ``finite_json`` wrote with ``json`` (what orjson refuses) is already so spelled."""
    assert b"".join(respelled(legacy(value), 64 * 1024)) == legacy(value)


@pytest.mark.parametrize("value", [
    [1e-05, -1.2e-05, 9.99e-05, 0.0001, 10.00001, 100.00005, -3.0000001e-06, 1e-07, 1.5e-300, 1e16, 1e22, -0.0],
    {"text": "x = 0.00001e-5 \"é\" \x7f", "0.00001": [0.00001], "e-5": "e-5"},
])
def test_the_spellings_that_differ(value):
    assert orjson.dumps(value) != legacy(value)
    assert b"".join(respelled(orjson.dumps(value), 4)) == legacy(value)


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.lists(st.integers(0, 70_000), unique=True, max_size=12).map(sorted), max_size=8),
       text=TEXT, piece=st.sampled_from([1, 5, 64 * 1024]))
def test_a_stored_packed_mask_is_written_as_its_lists(steps, text, piece):
    """The reply of a stored result shows each mask as the CSR lists, wherever it sits, and leaves
    a string that spells a packed mask alone (its quotes are escaped there)."""
    masks = SamplingMasks()
    for step in steps:
        masks.add(np.asarray(step, dtype=np.int32))
    fake = orjson.dumps(masks.packed()).decode()
    stored = {"choices": [{"text": text + fake, "sampling_mask": masks.packed(), "logprobs": [1e-05]},
                          {"sampling_mask": None}], "tail": fake}
    expected = {"choices": [{"text": text + fake, "sampling_mask": masks.csr(), "logprobs": [1e-05]},
                            {"sampling_mask": None}], "tail": fake}
    parts = list(stored_pieces(orjson.dumps(stored), piece))
    assert b"".join(parts) == legacy(expected)
