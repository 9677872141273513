"""What differs between the worker kinds, each as its own class: the queues it consumes, its pool,
the runtime it builds (workers/runtimes.py), the sweeps it runs beside its tasks, what its
heartbeat says, and what it prepares before taking work. ``workers/worker_main.py`` starts any of
them the same way."""

from __future__ import annotations

import logging
from typing import ClassVar

from domain.infra.gpu_affinity import register_direct_queue
from domain.names import (
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
)
from domain.settings import Settings
from workers.runtime import Runtime
from workers.runtimes import CpuRuntime, GpuRuntime, WebhooksRuntime

log = logging.getLogger(__name__)


class WorkerKind:
    name: ClassVar[str]
    runtime_class: ClassVar[type[Runtime]] = Runtime
    # The tasks whose messages this kind's workers hold: what a dead one held goes back to the
    # queue once its heartbeat expires, not after the visibility timeout (workers/held_messages.py).
    tasks_held: ClassVar[tuple[str, ...]]
    pool: ClassVar[str] = "solo"

    def __init__(self, settings: Settings, worker: str):
        self.settings, self.worker = settings, worker  # worker: its name (domain.names.worker_name)

    def queues(self) -> tuple[str, ...]:
        raise NotImplementedError

    def concurrency(self) -> int:
        return 1

    def prefetch(self) -> int:
        return 1

    def configure(self, app) -> None:
        """Settle the app's tasks before the worker starts (its tasks are imported by then)."""

    def start_sweeps(self, rt) -> None:
        """Start what this kind runs beside its tasks (reapers, sweepers), once the worker is ready."""

    def status(self, rt, held: list[str]) -> dict:
        """What its heartbeat says besides its name: ``held``, the delivery tags it holds."""
        return {"held": held}

    def prepare_pool_process(self, rt) -> None:
        """In each pool process as it starts (prefork), with that process's own runtime."""

    def before_consuming(self, rt) -> None:
        """In the main process, before it takes any message."""


class CpuWorker(WorkerKind):
    name = "cpu"
    runtime_class = CpuRuntime
    tasks_held = (PREPROCESS_TASK, RENDER_TASK)
    # Prefork even for one process, because only prefork enforces Celery's time limits (the solo
    # pool enforces none). More processes than cores: a job waiting on slow media holds its
    # process without using the CPU, and one key may hold at most ROLLOUT_CPU_PER_KEY slots
    # (domain/infra/fair_share.py), so the rest stay free for other keys.
    pool = "prefork"

    def queues(self) -> tuple[str, ...]:
        return (PREPROCESS_QUEUE,)

    def concurrency(self) -> int:
        return self.settings.cpu_concurrency

    def start_sweeps(self, rt) -> None:
        from domain.infra.fair_share import start_sweeper
        from engine.transport import sweep_orphaned_segments

        # Segments of producers killed together with their resource tracker. It judges owners by
        # pid, so run one CPU worker per pid namespace that shares this /dev/shm (compose does).
        sweep_orphaned_segments()
        start_sweeper(rt.share("cpu"), rt.publish)  # wakes what a dead worker left parked
        _start_job_reapers(rt)

    def prepare_pool_process(self, rt) -> None:
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

    def before_consuming(self, rt) -> None:
        # Import the processors (torch, transformers) here, before the pool forks: each pool process
        # then starts with them imported and shares their pages, where each imported them itself
        # (3 s of CPU and 300 MB apiece on the development machine). Importing runs no torch op, so
        # no thread pool exists yet to be lost by the fork.
        import processors.registry  # noqa: F401


class GpuWorker(WorkerKind):
    name = "gpu"
    runtime_class = GpuRuntime
    tasks_held = (GENERATE_TASK, SCORE_LINES_TASK)
    # One process owns the model and runs one batch at a time in its pool thread, while the event
    # loop reserves the next batch (workers/tasks/gpu_batching.py).
    pool = "threads"

    def queues(self) -> tuple[str, ...]:
        # The prompts whose prefix it holds come to its own queue (domain/infra/gpu_affinity.py).
        return (self.settings.generate_queue, SHARED_GENERATE_QUEUE, direct_queue(self.worker))

    def prefetch(self) -> int:
        # celery-batches batches only reserved messages, so the prefetch is two batches rather than 1.
        return 2 * self.settings.batch_rows

    def configure(self, app) -> None:
        generate = app.tasks[GENERATE_TASK]
        generate.flush_every = self.settings.batch_rows
        generate.max_wait = self.settings.gpu_batch_wait_ms / 1000
        generate.flush_interval = 0.001  # a tick: each decides whether to flush (see workers/tasks/gpu_batching.py)
        generate.queues = self.queues()

    def start_sweeps(self, rt) -> None:
        _start_job_reapers(rt)
        register_direct_queue(rt.redis, self.worker)

    def status(self, rt, held: list[str]) -> dict:
        from workers.gpu.progress import ProgressStamp

        generate = rt.celery.tasks[GENERATE_TASK]
        ready = rt.model_ready
        held = held + generate.held_delivery_tags()
        stats = rt.engine.stats if ready else None
        forwards = stats.decode_steps + stats.prefill_forwards if stats is not None else 0
        progress = self.__dict__.setdefault("_progress", ProgressStamp())
        # The weight version it serves (what SGLang-style /get_model_info reports); the generate
        # messages celery-batches buffers out of Celery's own state; the jobs its session runs,
        # of which another worker begins no attempt (domain/jobs/attempts.py); when it last moved
        # (workers/gpu/progress.py: /healthz names a worker that holds messages and does not).
        return {"model_ready": ready, "weight_version": rt.engine.weight_version if ready else None,
                "held": held, "node": self.settings.node_id, "direct_queue": direct_queue(self.worker),
                "running": generate.running_job_ids(), "progress_at": progress.observe(forwards, held)}

    def before_consuming(self, rt) -> None:
        # The model loads and passes its fidelity check before the worker consumes: a worker whose
        # model cannot serve (it failed to load, or its logprobs are not the model's own) exits
        # holding no message, and every job waits for a worker that can.
        rt.load_model()


class WebhooksWorker(WorkerKind):
    name = "webhooks"
    runtime_class = WebhooksRuntime
    tasks_held = (JOB_ENDED_TASK, DELIVER_TASK)
    # Deliveries wait on the network, not the CPU: threads, many of them, of which one key holds
    # at most ROLLOUT_WEBHOOK_PER_KEY (domain/infra/fair_share.py), so hanging receivers of one
    # key leave threads for everyone else.
    pool = "threads"

    def queues(self) -> tuple[str, ...]:
        return (WEBHOOKS_QUEUE,)

    def concurrency(self) -> int:
        return self.settings.webhook_concurrency

    def start_sweeps(self, rt) -> None:
        from domain.infra.fair_share import start_sweeper
        from domain.webhooks.reaper import start_webhook_reaper

        start_sweeper(rt.share("webhooks"), rt.publish)  # wakes what a dead worker left parked
        start_webhook_reaper(rt, stall_s=self.settings.stalled_job_after)  # webhooks whose message a crash lost


class BatchesWorker(WorkerKind):
    name = "batches"
    tasks_held = (ENQUEUE_CHUNK_TASK, CANCEL_BATCH_TASK, EXPIRE_BATCH_TASK)

    def queues(self) -> tuple[str, ...]:
        return (BATCHES_QUEUE,)

    def start_sweeps(self, rt) -> None:
        from domain.batches.reaper import start_batch_reaper

        _ = rt.model_facts  # which lines need no processor: read the model's config once, now
        start_batch_reaper(rt, stall_s=self.settings.stalled_job_after)  # chunks and expiry checks a crash lost


KINDS: dict[str, type[WorkerKind]] = {kind.name: kind for kind in (CpuWorker, GpuWorker, WebhooksWorker, BatchesWorker)}


def _start_job_reapers(rt) -> None:
    from domain.jobs.reaper import start_after_death_reaper, start_direct_queue_drain, start_reaper

    start_reaper(rt, stall_s=rt.settings.stalled_job_after)  # jobs whose message a crash lost
    start_after_death_reaper(rt)  # ... looked for at once when a worker dies
    start_direct_queue_drain(rt)  # ... and what waited in a dead GPU worker's own queue
