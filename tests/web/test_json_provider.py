"""The API's JSON responses (web/serving/json_body.py ``JsonProvider``): written by orjson, the way Flask's
own provider writes them, and by Flask's path for what orjson would write differently."""

from __future__ import annotations

import datetime
import json

import flask
import pytest
from flask.json.provider import DefaultJSONProvider

from web.serving.json_body import JsonProvider


@pytest.fixture
def app():
    app = flask.Flask(__name__)
    app.json = JsonProvider(app)
    with app.app_context():
        yield app


def flask_body(app, value) -> bytes:
    """What Flask's own provider answers for ``value``."""
    return DefaultJSONProvider.response(app.json, value).get_data()


@pytest.mark.parametrize("value", [
    {"b": [1, 2.5, None, True], "a": {"z": "text", "y": [[7, -1.25]]}},
    [{"id": "job_1"}, {"id": "job_2"}],
    {"nested": {"b": 1, "a": 2}},
])
def test_a_plain_value_is_written_as_flask_writes_it(app, value):
    response = app.json.response(value)
    assert response.mimetype == "application/json"
    assert response.get_data() == flask_body(app, value)


@pytest.mark.parametrize("value", [
    {1: "a key that is not a string"},
    {"big": 2**70},  # past 64 bits: orjson refuses it
    {"when": datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC)},  # Flask writes an HTTP date
    {"lone": "a\ud800b"},
])
def test_what_orjson_would_write_otherwise_takes_flasks_path(app, value):
    assert app.json.response(value).get_data() == flask_body(app, value)


def test_non_finite_numbers_are_null_and_text_stays_text(app):
    body = app.json.response({"logprobs": [float("nan"), float("-inf"), -0.5], "text": "é ✓"}).get_data()
    assert json.loads(body, parse_constant=lambda name: pytest.fail(name)) == {
        "logprobs": [None, None, -0.5], "text": "é ✓"}


def test_debug_responses_stay_indented_for_people(app):
    app.debug = True
    assert app.json.response({"a": 1}).get_data() == b'{\n  "a": 1\n}\n'
