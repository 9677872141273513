"""A failed job stores only its error's code and message; the type, and so the HTTP status a
synchronous route answers with, comes back from the code (engine.errors.RolloutError.from_record)."""

from __future__ import annotations

import pytest

import web.app  # noqa: F401  (imports every module that declares an error type)
from engine.errors import InternalError, RolloutError


def declared() -> list[type[RolloutError]]:
    found, todo = [], [RolloutError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "code" in cls.__dict__:
            found.append(cls)
    return found


def test_each_code_means_one_status():
    statuses: dict[str, set[int]] = {}
    for cls in declared():
        statuses.setdefault(cls.code, set()).add(cls.http_status)
    assert {code: s for code, s in statuses.items() if len(s) > 1} == {}


@pytest.mark.parametrize("cls", declared(), ids=lambda cls: cls.__name__)
def test_a_stored_error_comes_back_with_its_type(cls):
    restored = RolloutError.from_record({"code": cls.code, "message": "m", "errors": {"field": "x"}})
    assert (restored.code, restored.http_status, restored.retryable) == (cls.code, cls.http_status, cls.retryable)
    assert (restored.message, restored.errors) == ("m", {"field": "x"})


def test_an_unknown_code_is_an_internal_error():
    restored = RolloutError.from_record({"code": "from_a_newer_worker", "message": "m"})
    assert isinstance(restored, InternalError) and restored.http_status == 500
