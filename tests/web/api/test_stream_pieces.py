"""A stream's result is written in pieces (web/api/streams.py ``sse_pieces``): the same bytes as one
message, pieces of a bounded size, and never the whole encoded result in memory at once."""

from __future__ import annotations

import json
import tracemalloc

from web.api.streams import PIECE_BYTES, sse, sse_pieces


def big_result(tokens: int) -> dict:
    """A job view of one choice of ``tokens`` tokens with 5 top logprobs each (~85 bytes a token)."""
    return {"id": "job_x", "status": "succeeded", "result": {"choices": [{
        "token_ids": list(range(tokens)), "logprobs": [-0.123456789] * tokens,
        "top_logprobs": [[[t, -0.5], [t + 1, -1.5], [t + 2, -2.5], [t + 3, -3.5], [t + 4, -4.5]] for t in range(tokens)],
    }]}}


def test_the_pieces_make_the_same_message_and_each_is_bounded():
    data = big_result(2_000)
    pieces = list(sse_pieces(data, event="result"))
    assert b"".join(pieces) == sse(data, event="result")
    assert len(pieces) > 1 and all(len(piece) < 2 * PIECE_BYTES for piece in pieces)
    small = {"id": "job_y", "status": "cancelled"}
    assert list(sse_pieces(small, event="result")) == [sse(small, event="result")]


def _peak_while_sent(data) -> tuple[int, int]:
    """(bytes sent, the most memory the pieces took above what ``data`` holds)."""
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        sent = sum(len(piece) for piece in sse_pieces(data, event="result"))
        return sent, tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()


def test_a_large_result_is_never_encoded_whole():
    small, large = big_result(10_000), big_result(80_000)
    whole = len(json.dumps(large, separators=(",", ":")))
    sent, peak = _peak_while_sent(large)
    assert sent > whole > 6_000_000
    # One message at once would hold the text and its bytes (2x whole); the pieces hold a bounded
    # window, the same for a result eight times larger.
    assert peak < whole / 10, (peak, whole)
    assert peak < 2 * _peak_while_sent(small)[1] + 256 * 1024
