"""The last load-time fidelity check of the served model, kept in Redis for ``/healthz`` and
``/get_model_info``: a GPU worker whose model fails it exits, so its heartbeat cannot say why.

One record, ``rq:model:check``: the model id, whether it passed, the reason and the measured
differences (``engine/fidelity.py``), the worker and the time. A worker that passes overwrites a
refusal, so the record always tells of the latest attempt.
"""

from __future__ import annotations

import json
import logging
import os
import time

import redis

from engine.errors import RolloutError

log = logging.getLogger(__name__)

KEY = "rq:model:check"
TTL_S = 7 * 24 * 3600


def record_model_check(client: redis.Redis, model: str, error: BaseException | None, report: dict | None = None) -> None:
    """Record a pass (``error`` None, with the ``report``) or the error that refused the model."""
    record = {"model": model, "passed": error is None, "worker_pid": os.getpid(), "at": time.time()}
    if error is None:
        record["report"] = report or {}
    else:
        typed = error if isinstance(error, RolloutError) else None
        record["code"] = typed.code if typed else "model_load_failed"
        record["reason"] = str(error)
        record["report"] = dict(typed.errors) if typed and typed.errors else {}
    try:
        client.set(KEY, json.dumps(record), ex=TTL_S)
    except redis.RedisError:
        log.warning("could not record the model check in Redis (it is away): %s", record)


def last_model_check(client: redis.Redis) -> dict | None:
    raw = client.get(KEY)
    return json.loads(raw) if raw else None
