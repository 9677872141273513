"""JSON from clients: parsed in one place, and refused whole when it holds what we cannot take.

Python's ``json`` accepts more than the JSON our clients' parsers (JavaScript, Go, serde) and our
own processes can take back: ``NaN`` and ``Infinity`` (and turns ``1e999`` into ``inf``), lone
surrogates such as ``"\\ud800"`` (no UTF-8 encoding exists: the tokenizer and Redis fail on them
later), integers past ``sys.get_int_max_str_digits()`` (a ``ValueError`` outside the decode
errors) and nesting until the interpreter's recursion limit (a ``RecursionError``). Every request
body, batch line and JSON form field goes through :func:`parse_json` instead.

    InvalidJsonError (400, invalid_json)                    not JSON, not UTF-8, or nested deeper
                                                            than MAX_JSON_DEPTH
    UnsupportedJsonValueError (422, unsupported_json_value) JSON holding a value above

The checks after parsing cost little for ordinary requests: the walk over the parsed value runs
only when the text nests deeper than allowed (read from its brackets outside strings, where there
are more brackets than that depth), or holds a surrogate escape.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

import flask
import orjson
from flask.json.provider import DefaultJSONProvider
from marshmallow import missing
from webargs.flaskparser import FlaskParser, is_json_request
from werkzeug.exceptions import UnsupportedMediaType

from domain.infra import finite_json
from engine.errors import Fault, InvalidRequestError, RolloutError

# Far deeper than any request we define, far shallower than the recursion limit, so nothing that
# walks a request later (marshmallow, json.dumps of metadata) can run out of stack.
MAX_JSON_DEPTH = 64
# A \u escape of a UTF-16 surrogate (D800-DFFF); a valid pair decodes to one code point.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# A JSON string (unrolled: a quote, plain characters, then escapes each followed by plain ones).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")


class InvalidJsonError(RolloutError):
    code = "invalid_json"
    fault = Fault.MALFORMED


class UnsupportedJsonValueError(InvalidRequestError):
    code = "unsupported_json_value"


def parse_json(data: bytes | str) -> Any:
    """The value of JSON text, or one of the errors above."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    except UnicodeDecodeError:
        raise InvalidJsonError("the body is not valid UTF-8") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise InvalidJsonError(f"the body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # the only other ValueError json raises: an integer longer than Python converts
        raise UnsupportedJsonValueError("a number has more digits than accepted") from None
    deep = text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(text) > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if deep or surrogates:
        _walk(value, check_strings=surrogates)
    return value


def _depth(text: str) -> int:
    """How deep the (valid) JSON ``text`` nests: its brackets outside strings, counted in order. Two
    regex passes, where walking the parsed value visited every item (bench/responses.py: a bulk
    submit of 64 jobs)."""
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(1 if bracket in "[{" else -1 for bracket in brackets), default=0)


def _refuse_constant(name: str) -> Any:
    raise UnsupportedJsonValueError(f"{name} is not a JSON number: send a finite number or null")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise UnsupportedJsonValueError(f"{text[:32]} is out of the range of a 64-bit float")
    return number


def _walk(value: Any, *, check_strings: bool) -> None:
    # Iterative: the value may be as deep as the parser allowed, deeper than our own stack.
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items = list(node.values())
            if check_strings:
                for key in node:
                    _check_string(key)
        elif isinstance(node, list):
            items = node
        else:
            if check_strings and isinstance(node, str):
                _check_string(node)
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        stack.extend((item, depth + 1) for item in items if isinstance(item, dict | list | str))


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedJsonValueError(
            "a string holds a lone UTF-16 surrogate (such as \\ud800), which is not text") from None


def _too_deep() -> InvalidJsonError:
    return InvalidJsonError(f"the JSON is nested deeper than {MAX_JSON_DEPTH} levels")


# Responses through orjson: a step's lookup of 64 ended jobs encodes in 0.16 against 2.0 ms. Dates,
# dataclasses and the rest it would write unlike Flask raise instead (passed through), and take Flask's path.
# Flask has no option for another encoder in ``response``, so it is overridden, reusing its private
# ``_prepare_response_obj`` (the arguments as one value); tests/web/test_json_provider.py pins the output.
_ORJSON_RESPONSE = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


class JsonProvider(DefaultJSONProvider):
    """The app's JSON: requests parsed by :func:`parse_json`, responses without NaN or Infinity
    (orjson writes them as ``null``, as ``finite_json`` does)."""

    def response(self, *args: Any, **kwargs: Any) -> flask.Response:
        if self.compact is False or (self.compact is None and self._app.debug):
            return super().response(*args, **kwargs)  # indented, for people
        obj = self._prepare_response_obj(args, kwargs)
        try:
            body = orjson.dumps(obj, option=_ORJSON_RESPONSE | (orjson.OPT_SORT_KEYS if self.sort_keys else 0))
        except TypeError:  # a key that is not a string, an integer past 64 bits, a lone surrogate, a date
            return super().response(*args, **kwargs)
        return self._app.response_class(body + b"\n", mimetype=self.mimetype)

    def loads(self, s: str | bytes, **kwargs: Any) -> Any:
        return parse_json(s)

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        kwargs.setdefault("default", self.default)
        kwargs.setdefault("ensure_ascii", self.ensure_ascii)
        kwargs.setdefault("sort_keys", self.sort_keys)
        return finite_json.dumps(obj, **kwargs)


class BodyParser(FlaskParser):
    """webargs' Flask parser, reading JSON bodies with :func:`parse_json` (it calls ``json.loads``
    itself, past the app's JSON provider)."""

    def _raw_load_json(self, req: flask.Request) -> Any:
        if not is_json_request(req):
            if req.content_length or "chunked" in req.headers.get("Transfer-Encoding", "").lower():
                # A body not declared JSON was read as no body at all (422 on fields it holds).
                raise UnsupportedMediaType("this route takes a JSON body: send it with Content-Type: "
                                           "application/json")
            return missing
        return parse_json(req.get_data(cache=True))
