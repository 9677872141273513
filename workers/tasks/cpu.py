"""The CPU task: fetch media through the guard, run the model's processor, hand over to the GPU.

Time limits: the CPU worker runs the prefork pool (workers/worker_main.py), where Celery enforces
both. The soft limit raises in the task, which fails the job with ``job_time_limit_exceeded``. The
hard limit kills the pool child (the task ignored the soft one, e.g. stuck in C code) and Celery
acknowledges the message without running any of our code, so :class:`PreprocessRequest` fails the
job then, with the same code.

Fairness: a job runs only while its key holds fewer than ``ROLLOUT_CPU_PER_KEY`` preprocessing
slots; otherwise its message is parked until one of the key's jobs ends (domain/infra/fair_share.py says
why this shape), so one key's slow media never hold every process.

Redis at its maxmemory: a write it refuses (the prompt's save, the ``generate`` message) puts the
message back, the job untouched (``workers/tasks/outage.py``); it runs again once Redis has room.

Fencing (domain/jobs/attempts.py): each run of a job here is numbered as it starts. A worker paused
past its heartbeat (mid-fetch, say) has its message run by another CPU worker meanwhile; when it
wakes, its run is no longer the newest, so it saves no prompt, sends no ``generate`` and fails
nothing (its fetch deadline passed while it slept), and frees the feature memory it made.
"""

from __future__ import annotations

import json
import logging
import time

from celery import Task, shared_task
from celery.exceptions import SoftTimeLimitExceeded
from celery.worker import state as worker_state
from celery.worker.request import Request

from domain.infra.logs import job_context
from domain.infra.metrics import count, observe_stage
from domain.infra.redis_client import REDIS_DOWN
from domain.jobs.prompt_codec import encode_prompt, release_handles
from domain.jobs.request import JobRequest
from domain.jobs.store import TERMINAL
from domain.jobs.stored_job import StoredJob
from domain.jobs.submission import placement, send_placed
from domain.lifecycle import fail_job, fail_unexpected, resume_followups
from domain.names import PREPROCESS_QUEUE, PREPROCESS_TASK
from engine.errors import JobTimeoutError, NotFoundError, RolloutError
from engine.request_rules import new_tokens_of
from workers.memory_refusal import refused_for_memory
from workers.runtime import runtime
from workers.tasks.outage import requeued_while_redis_is_down

log = logging.getLogger(__name__)


class PreprocessRequest(Request):
    """Celery's request of a preprocess task; a hard time limit fails its job (see the module docs)."""

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        # During a cold shutdown Celery kills tasks through this path too: that is no timeout.
        if not soft and not worker_state.should_terminate:
            job_id = self.args[0]
            rt = runtime(self.app)
            fail_job(rt, job_id, JobTimeoutError(f"preprocessing exceeded its hard time limit ({timeout} s)"))
            try:
                owner = rt.jobs.get(job_id)["owner"]
            except NotFoundError:
                return
            rt.share("cpu").release(owner, job_id, rt.publish)  # the killed task could not


class PreprocessTask(Task):
    Request = PreprocessRequest


@shared_task(name=PREPROCESS_TASK, bind=True, base=PreprocessTask)
def preprocess(self, job_id: str, retry_handles: bool = False) -> None:
    with job_context(job_id), requeued_while_redis_is_down(f"preprocessing job {job_id}", runtime(self.app).redis):
        _preprocess(self.app, job_id, retry_handles)


def _preprocess(app, job_id: str, retry_handles: bool) -> None:
    rt = runtime(app)
    job = rt.jobs.read_job(job_id)
    if job is None:
        return  # expired or never existed: nothing to do
    # A redelivered message for a job that moved on is a no-op; a job whose feature handles could
    # not be opened comes back here (retry_handles) to be preprocessed again on this node.
    share = rt.share("cpu")
    if job.status in TERMINAL or (job.status == "generating" and not retry_handles):
        # A woken message has its slot reserved: give it to the key's next parked message.
        share.release(job.owner, job_id, rt.publish)
        if job.status in TERMINAL:
            resume_followups(rt, [job.record])
        return
    if not share.acquire_or_park(job.owner, job_id, task=PREPROCESS_TASK, args=[job_id],
                                 kwargs={"retry_handles": retry_handles}, queue=PREPROCESS_QUEUE):
        return  # the key holds its share: parked, woken when one of its jobs ends
    try:
        _run_job(app, rt, job_id, job, retry_handles)
    finally:
        share.release(job.owner, job_id, rt.publish)


def _run_job(app, rt, job_id: str, job: StoredJob, retry_handles: bool) -> None:
    rt.jobs.advance(job_id, "preprocessing")
    fence = rt.jobs.claim_preprocessing(job_id)
    started = time.perf_counter()
    try:
        request = job.request
        processed = run_processor(rt, request, owner=job.owner)
    except SoftTimeLimitExceeded:
        fail_job(rt, job_id, JobTimeoutError("preprocessing exceeded its time limit"), fence=fence)
        return
    except RolloutError as error:
        fail_job(rt, job_id, error, fence=fence)
        return
    except REDIS_DOWN:
        raise  # an outage (the multimodal cache lives in Redis), not this job's fault
    except Exception as error:
        if refused_for_memory(rt.redis, error):
            raise  # Redis at its maxmemory (the multimodal cache's write): requeued, not failed
        fail_unexpected(rt, job_id, "preprocessing", fence=fence)
        return
    elapsed = time.perf_counter() - started
    observe_stage(rt.redis, "preprocess", elapsed)
    if processed.items:
        count(rt.redis, "mm_cache_hit", processed.cache_hits)
        count(rt.redis, "mm_cache_miss", len(processed.items) - processed.cache_hits)
    payload = encode_prompt(processed, preprocess_seconds=elapsed, node_id=rt.settings.node_id)
    if not rt.jobs.save_prompt_fenced(job_id, json.dumps(payload), fence, generating_ok=retry_handles):
        # A newer run of this job started (this worker seemed dead for a while), or the job moved on:
        # that run's prompt is the job's. Nobody opens these handles: free them now.
        log.warning("job %s: preprocessing run %d is late; its prompt is dropped", job_id, fence.number)
        release_handles(rt.redis, [handle for item in payload["items"] for handle in item["features"].values()])
        return
    # To the GPU worker that holds its prefix; handles name memory on this node, so only this
    # node's GPU workers may open them.
    media = [(item["offset"][0], item["content_hash"]) for item in payload["items"] if item["content_hash"]]
    send_placed(app, rt.redis, [placement(job_id, job.owner, request, payload["token_ids"], media=media,
                                          transport=payload["transport"], node_id=rt.settings.node_id)])


def run_processor(rt, request: JobRequest, *, owner: str):
    """``owner``: the job's API key id; the multimodal cache's uuid entries are private to it."""
    from processors.pipeline import preprocess as preprocess_request

    return preprocess_request(
        request.processor_input(), processor=rt.processor, fetcher=rt.fetcher, cache=rt.mm_cache, transport=rt.transport,
        limits=rt.limits, owner=owner,
        new_tokens=new_tokens_of(request.kind, request.sampling.max_tokens, request.completion_token_ids),
    )
