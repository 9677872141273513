"""The render task (queue ``preprocess``): chat messages → exact token ids, for ``POST /v1/render``.

It runs where a job's preprocessing runs, with the same processor, fetcher (one media deadline for
all images), configured limits and per-key share of the worker (domain/renders.py says why).
"""

from __future__ import annotations

import json
import logging
import time

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from domain.infra.redis_client import REDIS_DOWN
from domain.names import PREPROCESS_QUEUE, RENDER_TASK
from domain.renders import answer_render, error_answer, request_key
from engine.errors import InternalError, JobTimeoutError, RolloutError
from workers.runtime import runtime
from workers.tasks.outage import requeued_while_redis_is_down

log = logging.getLogger(__name__)


@shared_task(name=RENDER_TASK, bind=True)
def render(self, render_id: str) -> None:
    rt = runtime(self.app)
    with requeued_while_redis_is_down(f"render {render_id}"):
        raw = rt.redis.get(request_key(render_id))
        if raw is None:
            return  # the caller stopped waiting: nothing to do
        request = json.loads(raw)
        share = rt.share("cpu")
        if time.time() > request["expires_at"]:
            share.release(request["owner"], render_id, rt.publish)  # a slot woken for it, if any
            return
        if not share.acquire_or_park(request["owner"], render_id, task=RENDER_TASK, args=[render_id], kwargs={},
                                     queue=PREPROCESS_QUEUE):
            return  # parked until one of the key's jobs or renders ends
        try:
            answer_render(rt.redis, render_id, _render(rt, request))
        finally:
            share.release(request["owner"], render_id, rt.publish)


def _render(rt, request: dict) -> dict:
    from processors.render import render as render_messages

    try:
        return {"result": render_messages(request["messages"], rt.processor, fetcher=rt.fetcher, cache=rt.mm_cache,
                                          limits=rt.limits, owner=request["owner"])}
    except SoftTimeLimitExceeded:
        return error_answer(JobTimeoutError("rendering exceeded its time limit"))
    except RolloutError as error:
        return error_answer(error)
    except REDIS_DOWN:
        raise
    except Exception:
        log.exception("unexpected error while rendering")
        return error_answer(InternalError("internal error while rendering"))
