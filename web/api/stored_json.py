"""A stored JSON value sent as the streams spell JSON, a piece at a time, without decoding it.

A job's result is stored as orjson writes it (``domain/infra/finite_json.compact``); a stream
has always sent ``json.dumps``' spelling (``web/api/streams.py`` ``sse``). Both write the same values,
but orjson leaves characters past ASCII (and DEL) unescaped and writes floats under 1e-4 its own
way (``0.00001``, ``1e-7``), where ``json`` writes ``\\u`` escapes and Python's repr (``1e-05``,
``1e-07``). Decoding the stored bytes to encode them again holds the result about five times over
as Python objects while a stream is open; :func:`respelled` rewrites only the tokens spelled
otherwise and passes the rest through. Written by hand: no library re-spells JSON text without
decoding it whole.

A stored sampling mask is packed (``engine/sampling_mask.py``); :func:`stored_pieces` writes each
as the CSR lists every reply shows, from its arrays a slice at a time, never as a list of ints.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from engine.sampling_mask import unpacked_arrays

# Scanned from a place outside any string, each string is matched whole from its opening quote,
# so nothing inside one is taken for a number. Outside strings: a one-digit negative exponent,
# and a float under 1e-4 written out (only where a number starts: not the tail of ``10.00001``).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|e-\d(?!\d)|0\.0000\d+')
_NUMBER_BYTES = frozenset(b"0123456789.")
# A packed mask as orjson writes the dict of engine/sampling_mask.pack (its keys in that order).
# Its quotes are bare, so it is never matched inside a JSON string (where they are escaped).
_PACKED_MASK = re.compile(rb'\{"packed":"(deflate-delta-u(?:16|32))","token_ids":"([A-Za-z0-9+/=]*)",'
                          rb'"offsets":"([A-Za-z0-9+/=]*)"\}')
_IDS_AT_ONCE = 16_384  # ids turned into text at once


def stored_pieces(data: bytes, piece: int) -> Iterator[bytes]:
    """:func:`respelled`, with each packed sampling mask written as its CSR lists
    (``{"token_ids": [...], "offsets": [...]}``)."""
    at = 0
    for match in _PACKED_MASK.finditer(data):
        yield from respelled(data, piece, at, match.start())
        yield from _mask_lists(match, piece)
        at = match.end()
    yield from respelled(data, piece, at, len(data))


def _mask_lists(match: re.Match, piece: int) -> Iterator[bytes]:
    token_ids, offsets = unpacked_arrays({"packed": match.group(1).decode(), "token_ids": match.group(2).decode(),
                                          "offsets": match.group(3).decode()})
    part = bytearray(b'{"token_ids":[')
    for name, values in (("token_ids", token_ids), ("offsets", offsets)):
        if name == "offsets":
            part += b'],"offsets":['
        for start in range(0, len(values), _IDS_AT_ONCE):
            part += (b"," if start else b"") + ",".join(map(str, values[start:start + _IDS_AT_ONCE].tolist())).encode()
            if len(part) >= piece:
                yield bytes(part)
                part.clear()
    part += b"]}"
    yield bytes(part)


def respelled(data: bytes, piece: int, start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """``data`` (compact JSON, as orjson or ``json.dumps`` wrote it) in ``json.dumps``' spelling
    (ASCII only, Python's float repr), in parts of at most ``piece`` bytes but for a respelled
    string, which comes in parts of its own. ``start``, ``end``: the part of ``data`` to write,
    each outside any string."""
    end = len(data) if end is None else end
    at = start
    for match in _TOKEN.finditer(data, start, end):
        start = match.start()
        new = _respell(match.group(), data[start - 1] if start else None)
        if new is None:
            continue
        yield from _slices(data, at, start, piece)
        yield from _slices(new, 0, len(new), piece)
        at = match.end()
    yield from _slices(data, at, end, piece)


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
