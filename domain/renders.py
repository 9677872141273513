"""``POST /v1/render`` served by a CPU worker: the API hands the messages over and waits, bounded.

Rendering fetches and processes the messages' images, which a key controls the speed of. Done in
the API it held a request thread for as long as the media took, under defaults rather than the
configured limits. Here it runs as the ``rollout.render`` task on the ``preprocess`` queue, under
the same limits, media deadline and per-key share of the CPU worker as a job; the API waits for
the answer at most the media deadline plus :data:`WAIT_SLACK_S`.

Redis layout (short-lived: nobody reads a render after its caller stopped waiting):

    rq:render:<id>        string: {"owner", "messages", "expires_at"} (JSON)
    rq:render:<id>:done   list: one JSON answer, {"result": ...} or {"error": {code, message, ...}}
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from celery import Celery

from domain.infra.redis_records import new_id
from domain.names import PREPROCESS_QUEUE, RENDER_TASK
from engine.errors import RolloutError, ServiceUnavailableError

# Queueing and processing on top of the media deadline, before the API gives up waiting.
WAIT_SLACK_S = 15.0
ANSWER_TTL_S = 60


class RenderTimeoutError(ServiceUnavailableError):
    """No CPU worker answered in time (all busy, or none running)."""

    code = "render_timed_out"


class NoRenderWorkerError(ServiceUnavailableError):
    """No CPU worker runs: a render would only wait out its bound."""

    code = "no_cpu_worker"


def request_key(render_id: str) -> str:
    return f"rq:render:{render_id}"


def done_key(render_id: str) -> str:
    return f"rq:render:{render_id}:done"


def wait_bound(media_deadline_s: float) -> float:
    return media_deadline_s + WAIT_SLACK_S


def request_render(client: redis.Redis, celery: Celery, *, owner: str, messages: list, wait_s: float) -> str:
    """Store the render and queue it; its id."""
    render_id = new_id("render")
    body = {"owner": owner, "messages": messages, "expires_at": time.time() + wait_s}
    client.set(request_key(render_id), json.dumps(body), ex=int(wait_s) + ANSWER_TTL_S)
    celery.send_task(RENDER_TASK, args=[render_id], queue=PREPROCESS_QUEUE)
    return render_id


def wait_render(client: redis.Redis, render_id: str, wait_s: float) -> dict[str, Any]:
    """The rendered ``{token_ids, content_parts}``; the worker's error raised as itself."""
    deadline = time.monotonic() + wait_s
    # Short waits keep each call well inside the Redis client's socket timeout.
    while (remaining := deadline - time.monotonic()) > 0:
        popped = client.blpop([done_key(render_id)], timeout=max(1, min(remaining, 5.0)))
        if popped is not None:
            answer = json.loads(popped[1])
            if "error" in answer:
                raise RolloutError.from_record(answer["error"])  # its type, by its code
            return answer["result"]
    # The request stays until its TTL: a worker that gets to it now sees it expired and skips it.
    raise RenderTimeoutError("no worker rendered the messages in time; retry shortly", headers={"Retry-After": "2"})


def answer_render(client: redis.Redis, render_id: str, answer: dict[str, Any]) -> None:
    pipe = client.pipeline()
    pipe.rpush(done_key(render_id), json.dumps(answer))
    pipe.expire(done_key(render_id), ANSWER_TTL_S)
    pipe.delete(request_key(render_id))
    pipe.execute()


def error_answer(error: RolloutError) -> dict[str, Any]:
    return {"error": error.to_dict()}
