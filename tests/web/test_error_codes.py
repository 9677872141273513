"""A failed job stores only its error's code and message; the type, and so the HTTP status a
synchronous route answers with, comes back from the code (engine.errors.RolloutError.from_record)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from domain.error_statuses import HTTP_STATUS, http_status
from engine.errors import Fault, InternalError, RolloutError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "processors", "workers", "web", "client")


def _import_everything() -> None:
    for package in PACKAGES:
        for module in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
            importlib.import_module(module.name)


_import_everything()


def declared() -> list[type[RolloutError]]:
    found, todo = [], [RolloutError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "code" in cls.__dict__:
            found.append(cls)
    return found


def test_each_code_means_one_kind_and_every_kind_has_a_status():
    faults: dict[str, set[Fault]] = {}
    for cls in declared():
        faults.setdefault(cls.code, set()).add(cls.fault)
    assert {code: f for code, f in faults.items() if len(f) > 1} == {}
    assert set(HTTP_STATUS) == set(Fault)


@pytest.mark.parametrize("cls", declared(), ids=lambda cls: cls.__name__)
def test_a_stored_error_comes_back_with_its_type(cls):
    restored = RolloutError.from_record({"code": cls.code, "message": "m", "errors": {"field": "x"}})
    assert (restored.code, restored.fault, restored.retryable) == (cls.code, cls.fault, cls.retryable)
    assert (restored.message, restored.errors) == ("m", {"field": "x"})


def test_an_unknown_code_is_an_internal_error():
    restored = RolloutError.from_record({"code": "from_a_newer_worker", "message": "m"})
    assert isinstance(restored, InternalError) and http_status(restored) == 500



def _codes_known_after(imports: str) -> set[str]:
    script = f"{imports}; from engine.errors import RolloutError; print(' '.join(RolloutError._by_code))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return set(done.stdout.split())


def test_the_api_process_knows_every_code_a_worker_may_store():
    # Fresh interpreters: this one has imported everything, so it would know every code anyway.
    # What a worker has imported once it has preprocessed and generated (parts load on first use).
    worker = _codes_known_after("from workers.celery_app import TASK_MODULES; import importlib; "
                                "[importlib.import_module(m) for m in TASK_MODULES]; import processors.registry, "
                                "processors.pipeline, processors.render, engine.generation, workers.gpu.session")
    assert worker - _codes_known_after("import web.app") == set()
