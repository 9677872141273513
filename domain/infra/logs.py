"""Structured logs: one JSON object per line, carrying the job ids being worked on.

A task sets the ids it works on with :func:`job_context`; every log line written inside carries
them as ``job_ids``, so one job can be followed through the API, CPU and GPU workers with grep.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pythonjsonlogger.json import JsonFormatter

_job_ids: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("job_ids", default=())


class _JobIdsFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ids = _job_ids.get()
        if ids:
            record.job_ids = list(ids)
        return True


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter("{asctime}{levelname}{name}{process}{message}", style="{"))
    handler.addFilter(_JobIdsFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


@contextmanager
def job_context(*job_ids: str) -> Iterator[None]:
    token = _job_ids.set(tuple(job_ids))
    try:
        yield
    finally:
        _job_ids.reset(token)
