"""A stored JSON value sent as the streams spell JSON, a piece at a time, without decoding it.

A job's result is stored as orjson writes it (``domain/infra/finite_json.compact``); a stream
has always sent ``json.dumps``' spelling (``web/api/streams.py`` ``sse``). Both write the same values,
but orjson leaves characters past ASCII (and DEL) unescaped and writes floats under 1e-4 its own
way (``0.00001``, ``1e-7``), where ``json`` writes ``\\u`` escapes and Python's repr (``1e-05``,
``1e-07``). Decoding the stored bytes to encode them again holds the result about five times over
as Python objects while a stream is open; :func:`respelled` rewrites only the tokens spelled
otherwise and passes the rest through. Written by hand: no library re-spells JSON text without
decoding it whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

# Scanned from a place outside any string, each string is matched whole from its opening quote,
# so nothing inside one is taken for a number. Outside strings: a one-digit negative exponent,
# and a float under 1e-4 written out (only where a number starts: not the tail of ``10.00001``).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|e-\d(?!\d)|0\.0000\d+')
_NUMBER_BYTES = frozenset(b"0123456789.")


def respelled(data: bytes, piece: int) -> Iterator[bytes]:
    """``data`` (compact JSON, as orjson or ``json.dumps`` wrote it) in ``json.dumps``' spelling
    (ASCII only, Python's float repr), in parts of at most ``piece`` bytes but for a respelled
    string, which comes in parts of its own."""
    at = 0
    for match in _TOKEN.finditer(data):
        start = match.start()
        new = _respell(match.group(), data[start - 1] if start else None)
        if new is None:
            continue
        yield from _slices(data, at, start, piece)
        yield from _slices(new, 0, len(new), piece)
        at = match.end()
    yield from _slices(data, at, len(data), piece)


def _respell(token: bytes, before: int | None) -> bytes | None:
    """``token`` as ``json.dumps`` writes it; None where it is spelled alike."""
    if token[0] == ord('"'):
        if token.isascii() and b"\x7f" not in token:
            return None
        return json.dumps(json.loads(token)).encode()
    if token[0] == ord("e"):
        return b"e-0" + token[2:]
    if before in _NUMBER_BYTES:
        return None
    return repr(float(token)).encode()


def _slices(data: bytes, start: int, end: int, piece: int) -> Iterator[bytes]:
    for at in range(start, end, piece):
        yield data[at:min(at + piece, end)]
