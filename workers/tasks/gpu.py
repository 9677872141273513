"""The GPU task: open the finalized items, generate in a continuous batch or score, store results.

Batching: :class:`workers.tasks.gpu_batching.GenerateBatches` hands this task the ``rollout.generate``
messages the worker has reserved, and the task runs a :class:`workers.gpu.session.GenerateSession`
in the worker's single pool thread: jobs join the engine's running batch between decode steps and
leave as they end, and the session takes more messages while it runs. transformers' continuous
batching cannot serve this path (it drops ``pixel_values``, docs/architecture.md): the scheduler is ours
(``engine/scheduler.py``).

Time limit: Celery enforces none here (celery-batches hands the batch to the pool without one, and
the threads pool cannot interrupt a thread anyway), so every job keeps its own deadline,
``ROLLOUT_TASK_SOFT_TIME_LIMIT`` seconds after it joins: its rows stop then and it fails with
``job_time_limit_exceeded``, its batch mates go on.

Weight updates (workers/gpu/weight_sync.py, driven by the session): a pending target stops new rows
from joining; in mode ``finish`` the running rows end on the old weights, in ``abort`` they end
now with ``finish_reason: "abort"`` and their tokens so far, in ``retract`` their jobs go back to
the queue to run again from the prompt on the new weights, in ``keep`` they hold still between two
steps and go on under the new weights (``Scheduler.weights_changed``). The batch then loads the
target and goes on; a worker that may not serve (paused, or the target failed to load here) hands its
messages back to the queue.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery import shared_task

from domain.infra.logs import job_context
from domain.infra.redis_client import REDIS_DOWN
from domain.jobs.prompt_codec import release_prompts
from domain.lifecycle import fail_unexpected
from domain.names import GENERATE_TASK
from workers.gpu.requeue import REQUEUE
from workers.memory_refusal import refused_for_memory
from workers.runtime import runtime
from workers.tasks.gpu_batching import GenerateBatches

if TYPE_CHECKING:
    from workers.gpu.session import GenerateSession

log = logging.getLogger(__name__)


@shared_task(name=GENERATE_TASK, base=GenerateBatches, bind=True, flush_every=16, flush_interval=0.005)
def generate(self, requests) -> str | None:
    rt = runtime(self.app)
    job_ids = list(dict.fromkeys(request.args[0] for request in requests))
    with job_context(*job_ids):
        try:
            engine = rt.wait_for_model()
        except Exception:
            for job_id in job_ids:
                fail_unexpected(rt, job_id, "loading the model")
            return None
        # Imported here, not above: every worker kind imports this module (Celery's include), and
        # the session brings torch, 1.5 s of a webhooks or batches worker's start for nothing.
        from workers.gpu.session import GenerateSession

        session = GenerateSession(rt, engine, self)
        try:
            return session.run(requests)
        except REDIS_DOWN:
            log.warning("Redis unavailable during a GPU session of %d jobs; their messages go back to the queue",
                        len(session.live))
            return REQUEUE
        except Exception as error:
            if refused_for_memory(rt.redis, error):
                log.warning("Redis at its maxmemory during a GPU session of %d jobs; their messages go back "
                            "to the queue", len(session.live))
                return REQUEUE
            settle_after_error(rt, session, self)
    return None


def settle_after_error(rt, session: GenerateSession, batches) -> None:
    """A session ended on an unexpected error. celery-batches only logs an exception from the batch
    body and leaves every job waiting, and settles (acknowledges) every message left on return; so:

    - the jobs whose ends Redis refused for memory, held (``workers/gpu/job_ends.py``), go back to
      the queue unfailed, first: their messages given back, where the acknowledgement left them to
      the job reaper (``ROLLOUT_STALLED_JOB_AFTER``);
    - each job still open fails; one Redis refuses to fail for memory goes back to the queue too.
      A superseded attempt's job is the newer attempt's to end (domain/jobs/attempts.py).
    """
    handed_back = session._ends.hand_back_held()  # the session's own ends, read by its own task
    if handed_back:
        log.warning("a GPU session ended on an error holding %d job ends Redis refused; their jobs go back to "
                    "the queue", handed_back)
    failed = []
    for live in (live for live in session.live.values() if not live.superseded):
        try:
            fail_unexpected(rt, live.job.id, "generating", fence=live.fence)
        except Exception as error:
            if not refused_for_memory(rt.redis, error):
                raise
            batches.hand_back(live.message_ids)
            continue
        failed.append(live)
    release_prompts(rt.redis, [live.prompt for live in failed])
