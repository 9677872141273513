"""The event loop and gunicorn read a request one way (web/serving/request_framing.py): the catalogue's
requests, mutated a few bytes at a time (seeded), each fed to the loop and, as sent, to gunicorn's
own parser. What the loop takes whole gunicorn takes with the same body; what the loop refuses and
gunicorn takes is refused for one of the loop's two stricter rules only (an HTTP/1.1 request
without Host, a transfer coding nothing here decodes); nothing else escapes as an exception."""

from __future__ import annotations

import random

from gunicorn.config import Config
from gunicorn.http.errors import InvalidHeader, NoMoreData, ParseException, UnsupportedTransferCoding
from gunicorn.http.parser import RequestParser

from tests.web.serving.http_catalogue import CATALOGUE
from web.serving.request_framing import IncomingRequest, Progress

CASES = 1500
ALPHABET = b"\r\n \t:;=\"0123456789abcdefABCDEF\x00\x7f\xff,/"


class _Socket:
    def __init__(self, data: bytes):
        self._data = data

    def recv(self, size: int) -> bytes:
        piece, self._data = self._data[:size], self._data[size:]
        return piece


def _mutated(rng: random.Random) -> bytes:
    data = bytearray(rng.choice(CATALOGUE).request(rng.random() < 0.5))
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data) + 1)
        kind = rng.random()
        if kind < 0.4:
            data[at:at] = bytes([rng.choice(ALPHABET)])
        elif at < len(data):
            if kind < 0.7:
                del data[at]
            else:
                data[at] = rng.choice(ALPHABET)
    return bytes(data)


def _gunicorns(data: bytes) -> bytes | None:
    """The body gunicorn reads from ``data`` as sent, or None where it refuses the request."""
    try:
        return next(RequestParser(Config(), _Socket(data), ("127.0.0.1", 1))).body.read()
    except (ParseException, NoMoreData, StopIteration):
        return None


def test_what_the_loop_takes_gunicorn_takes_alike_and_it_refuses_more_only_by_its_two_rules():
    rng = random.Random(56)
    taken = refused = 0
    for _ in range(CASES):
        data = _mutated(rng)
        request = IncomingRequest(Config(), 1 << 16, ("127.0.0.1", 1))
        step = rng.choice([None, 1, 7])
        for start in range(0, len(data), step or len(data)):
            if request.feed(data[start:start + (step or len(data))]) is not Progress.NEED_MORE:
                break
        if request.progress is Progress.COMPLETE:
            read = next(RequestParser(Config(), request.source(), ("127.0.0.1", 1))).body.read()
            assert _gunicorns(data) == read, data
            taken += 1
        elif request.progress is Progress.INVALID:
            refused += 1
            if _gunicorns(data) is not None:
                stricter = (isinstance(request.error, UnsupportedTransferCoding)
                            or (isinstance(request.error, InvalidHeader) and b"\nHost:" not in data))
                assert stricter, (request.error, data)
    assert taken > CASES // 20 and refused > CASES // 2  # the mutations reach both ways
