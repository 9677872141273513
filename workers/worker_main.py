"""Starting a Celery worker of one kind: which queues it consumes, with which pool, and why."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from celery import signals

from workers.celery_app import create_celery
from workers.infra.gpu_affinity import register_direct_queue
from workers.infra.heartbeats import start_heartbeat
from workers.infra.logs import configure_logging
from workers.names import (
    BATCHES_QUEUE,
    CANCEL_BATCH_TASK,
    DELIVER_TASK,
    ENQUEUE_CHUNK_TASK,
    EXPIRE_BATCH_TASK,
    GENERATE_TASK,
    JOB_ENDED_TASK,
    PREPROCESS_QUEUE,
    PREPROCESS_TASK,
    RENDER_TASK,
    SCORE_LINES_TASK,
    SHARED_GENERATE_QUEUE,
    WEBHOOKS_QUEUE,
    direct_queue,
    worker_name,
)
from workers.settings import Settings

log = logging.getLogger(__name__)

# The tasks whose messages each kind's workers hold: what a dead one held goes back to the queue
# once its heartbeat expires, not after the visibility timeout (workers/infra/held_messages.py).
TASKS_HELD_BY = {
    "cpu": (PREPROCESS_TASK, RENDER_TASK),
    "gpu": (GENERATE_TASK, SCORE_LINES_TASK),
    "webhooks": (JOB_ENDED_TASK, DELIVER_TASK),
    "batches": (ENQUEUE_CHUNK_TASK, CANCEL_BATCH_TASK, EXPIRE_BATCH_TASK),
}


@dataclass(frozen=True)
class WorkerKind:
    queues: tuple[str, ...]
    pool: str
    concurrency: int
    prefetch: int


def worker_kind(kind: str, settings: Settings) -> WorkerKind:
    if kind == "cpu":
        # Prefork even for one process, because only prefork enforces Celery's time limits (the
        # solo pool enforces none). More processes than cores: a job waiting on slow media holds
        # its process without using the CPU, and one key may hold at most ROLLOUT_CPU_PER_KEY
        # slots (workers/infra/fair_share.py), so the rest stay free for other keys.
        return WorkerKind((PREPROCESS_QUEUE,), "prefork", settings.cpu_concurrency, 1)
    if kind == "gpu":
        # One process owns the model and runs one batch at a time in its pool thread, while the
        # event loop reserves the next batch (workers/tasks/gpu_batching.py): celery-batches batches only
        # reserved messages, so the prefetch is two batches rather than 1.
        queues = (settings.generate_queue, SHARED_GENERATE_QUEUE)
        return WorkerKind(queues, "threads", 1, 2 * settings.batch_rows)
    if kind == "webhooks":
        # Deliveries wait on the network, not the CPU: threads, many of them, of which one key
        # holds at most ROLLOUT_WEBHOOK_PER_KEY (workers/infra/fair_share.py), so hanging receivers of
        # one key leave threads for everyone else.
        return WorkerKind((WEBHOOKS_QUEUE,), "threads", settings.webhook_concurrency, 1)
    if kind == "batches":
        return WorkerKind((BATCHES_QUEUE,), "solo", 1, 1)
    raise ValueError(f"unknown worker kind {kind!r}")


def run_worker(kind: str, settings: Settings, redis_url: str) -> None:
    app = create_celery(settings, redis_url)
    spec = worker_kind(kind, settings)
    name = worker_name(settings.node_id)
    queues = spec.queues
    if kind == "gpu":  # the prompts whose prefix it holds come to its own queue (gpu_affinity)
        queues = (*queues, direct_queue(name))
    app.conf.worker_prefetch_multiplier = spec.prefetch
    app.loader.import_default_modules()
    if kind == "gpu":
        generate = app.tasks[GENERATE_TASK]
        generate.flush_every = settings.batch_rows
        generate.max_wait = settings.gpu_batch_wait_ms / 1000
        generate.flush_interval = 0.001  # a tick: each decides whether to flush (see workers/tasks/gpu_batching.py)
        generate.queues = queues

    @signals.setup_logging.connect(weak=False)
    def keep_our_logging(**_):
        # Connected, so Celery leaves logging alone: ours is already configured (JSON lines).
        configure_logging(settings.log_level)

    @signals.worker_ready.connect(weak=False)
    def on_ready(sender=None, **_):
        try:
            start_parts(sender)
        except Exception:
            # Celery logs a signal handler that raises and runs on: a worker whose sweeps and
            # heartbeat never started would take work yet look dead. Exit, so that a supervisor
            # (`up`, compose) restarts it, and the log says why.
            log.exception("the %s worker could not start", kind)
            logging.shutdown()  # flush the log: os._exit skips it
            os._exit(3)

    def start_parts(consumer) -> None:
        from workers.infra.held_messages import celery_held_tags, start_held_message_sweep
        from workers.runtime import runtime

        rt = runtime(app)
        if kind == "cpu":
            from engine.transport import sweep_orphaned_segments

            # Segments of producers killed together with their resource tracker. It judges owners by
            # pid, so run one CPU worker per pid namespace that shares this /dev/shm (compose does).
            sweep_orphaned_segments()
        if kind in ("cpu", "webhooks"):
            from workers.infra.fair_share import start_sweeper

            start_sweeper(rt.share(kind), rt.publish)  # wakes what a dead worker left parked
        if kind in ("cpu", "gpu"):
            from workers.jobs.reaper import start_after_death_reaper, start_direct_queue_drain, start_reaper

            start_reaper(rt, stall_s=settings.stalled_job_after)  # jobs whose message a crash lost
            start_after_death_reaper(rt)  # ... looked for at once when a worker dies
            start_direct_queue_drain(rt)  # ... and what waited in a dead GPU worker's own queue
        if kind == "batches":
            from workers.batches.reaper import start_batch_reaper

            _ = rt.model_facts  # which lines need no processor: read the model's config once, now
            start_batch_reaper(rt, stall_s=settings.stalled_job_after)  # chunks and expiry checks a crash lost
        if kind == "webhooks":
            from workers.webhooks.reaper import start_webhook_reaper

            start_webhook_reaper(rt, stall_s=settings.stalled_job_after)  # webhooks whose message a crash lost
        # Messages a dead or cut-off worker of this kind held, back in seconds, not in an hour; its
        # heartbeat lists what it holds (a prefork worker's main process tracks its children's too).
        start_held_message_sweep(rt, kind, TASKS_HELD_BY[kind])

        if kind == "gpu":
            register_direct_queue(rt.redis, name)

        def status() -> dict:
            held = celery_held_tags(consumer)
            if kind == "gpu":
                return {**_gpu_status(rt), "held": held + _held_generate_tags(rt), "node": settings.node_id,
                        "direct_queue": direct_queue(name), "running": _running_jobs(rt)}
            return {"held": held}

        start_heartbeat(rt.redis, kind, name, status, every_s=settings.heartbeat_seconds)

    @signals.worker_process_init.connect(weak=False)
    def on_pool_process_start(**_):
        # Sent in each prefork pool process (and once by the solo pool, in the main process).
        from workers.runtime import fresh_runtime

        rt = fresh_runtime(app)  # a forked process must not use what its parent built
        if kind != "cpu":
            return
        from engine.errors import TransportError
        from engine.transport import sweep_orphaned_segments

        # A pool process preprocesses with its own processor and makes handles from its own
        # transport memory. Load the processor and read the model's limits now, not on the first
        # job (within worker_proc_alive_timeout, raised for this in workers/celery_app.py); and
        # reserve a shm pool now: the default 1 GiB took 0.45 s of a first image job alone here,
        # up to 1.7 s beside another pool process. A CUDA IPC pool stays for the first job that
        # needs it: GPU memory is the engine's, and a node serving token prompts never needs one.
        sweep_orphaned_segments()  # what a pool process killed before this one left behind
        _ = rt.processor, rt.limits
        try:
            if rt.transport_kind == "shm":
                _ = rt.transport
        except (TransportError, ValueError):
            # /dev/shm too small, or a transport this machine cannot make (cuda_ipc without CUDA):
            # logged now, and the process serves on (one that raised here would be restarted in a
            # loop); each job that needs the transport fails as it did before.
            log.exception("this pool process has no feature transport")

    @signals.worker_process_shutdown.connect(weak=False)
    @signals.worker_shutdown.connect(weak=False)
    def on_shutdown(**_):
        from workers.runtime import runtime

        rt = runtime(app)
        if "transport" in rt.__dict__:  # only a process that made handles owns transport memory
            rt.transport.close()

    if kind == "gpu":
        # The model loads and passes its fidelity check before the worker consumes: a worker whose
        # model cannot serve (it failed to load, or its logprobs are not the model's own) exits
        # holding no message, and every job waits for a worker that can.
        from workers.runtime import runtime

        try:
            runtime(app).load_model()
        except Exception:
            log.exception("the gpu worker's model cannot serve; exiting without taking work")
            logging.shutdown()
            os._exit(3)

    app.worker_main([
        "worker", "--queues", ",".join(queues), "--pool", spec.pool, "--concurrency", str(spec.concurrency),
        "--hostname", f"{kind}-{os.getpid()}@{settings.node_id}", "--loglevel", settings.log_level,
        "--without-gossip", "--without-mingle",
    ])


def _gpu_status(rt) -> dict:
    # The weight version a GPU worker serves (what SGLang-style /get_model_info reports).
    ready = rt.model_ready
    return {"model_ready": ready, "weight_version": rt.engine.weight_version if ready else None}


def _running_jobs(rt) -> list[str]:
    # The jobs this worker's session runs: another worker begins no attempt of them (workers/jobs/attempts.py).
    return rt.celery.tasks[GENERATE_TASK].running_job_ids()


def _held_generate_tags(rt) -> list[str]:
    # celery-batches keeps the generate messages it buffers out of Celery's own state.
    return rt.celery.tasks[GENERATE_TASK].held_delivery_tags()
