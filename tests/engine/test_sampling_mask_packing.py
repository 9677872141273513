"""A result's sampling mask is stored packed (engine/sampling_mask.py ``pack``): the CSR lists
come back exactly, for masks of every width (ids and step counts past 65,535), and the packed form
is a fraction of the JSON lists it replaces."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.choice import Choice
from engine.sampling_mask import PACKED_U16, PACKED_U32, SamplingMasks, is_packed, pack, packed_bytes, unpack

STEPS = st.lists(st.lists(st.integers(0, 200_000), unique=True, max_size=40).map(sorted), max_size=30)


def masks_of(steps: list[list[int]]) -> SamplingMasks:
    masks = SamplingMasks()
    for step in steps:
        masks.add(np.asarray(step, dtype=np.int32))
    return masks


@settings(max_examples=300, deadline=None)
@given(steps=STEPS)
def test_a_packed_mask_unpacks_to_its_csr_lists(steps):
    masks = masks_of(steps)
    packed = masks.packed()
    assert is_packed(packed) and unpack(packed) == masks.csr()
    assert unpack(orjson.loads(orjson.dumps(packed))) == masks.csr()  # as stored, as read back


@pytest.mark.parametrize(("steps", "tag"), [
    ([[0, 5, 65_535], [1, 2]], PACKED_U16),
    ([[0, 65_536], [3]], PACKED_U32),  # an id past 16 bits
    ([list(range(70_000)), [2]], PACKED_U32),  # a step of more than 65,535 ids
    ([], PACKED_U16),
])
def test_the_width_is_the_narrowest_that_holds_the_ids_and_counts(steps, tag):
    masks = masks_of(steps)
    assert masks.packed()["packed"] == tag and unpack(masks.packed()) == masks.csr()


def test_unbounded_masks_shrink_to_almost_nothing_and_top_k_ones_below_the_lists():
    dense = masks_of([list(range(640))] * 4000)  # #56's case: every id of a 640-id vocabulary, 4,000 tokens
    lists, packed = len(orjson.dumps(dense.csr())), len(orjson.dumps(dense.packed()))
    assert lists > 9_000_000 and packed < lists / 100
    rng = np.random.default_rng(0)
    sparse = masks_of([sorted(rng.choice(152_000, 20, replace=False).tolist()) for _ in range(500)])
    ids = 500 * 20
    assert len(orjson.dumps(sparse.packed())) <= packed_bytes(ids * 4) + packed_bytes(501 * 4) + 64
    assert len(orjson.dumps(sparse.packed())) < len(orjson.dumps(sparse.csr()))


def test_a_choice_read_from_a_record_holds_the_lists_a_stored_list_mask_too():
    csr = {"token_ids": [5, 7, 9, 7], "offsets": [0, 3, 4]}
    packed = pack(np.asarray(csr["token_ids"]), np.asarray(csr["offsets"]))
    record = {"index": 0, "token_ids": [7, 7], "logprobs": None, "finish_reason": "length", "sampling_mask": packed}
    assert Choice.from_record(json.loads(json.dumps(record))).sampling_mask == csr
    assert Choice.from_record({**record, "sampling_mask": csr}).sampling_mask == csr  # stored before packing
    assert Choice.from_record({**record, "sampling_mask": None}).sampling_mask is None
