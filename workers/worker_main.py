"""Starting a Celery worker of one kind (``workers/worker_kinds.py`` says how each kind differs):
its app, its runtime class, its queues and pool, its sweeps and heartbeat once ready, and the
shutdown of what it owns."""

from __future__ import annotations

import logging
import os

from celery import signals

from domain.infra.heartbeats import start_heartbeat
from domain.infra.logs import configure_logging
from domain.names import worker_name
from domain.settings import Settings
from workers.celery_app import create_celery
from workers.worker_kinds import KINDS, WorkerKind

log = logging.getLogger(__name__)


def worker_kind(kind: str, settings: Settings) -> WorkerKind:
    if kind not in KINDS:
        raise ValueError(f"unknown worker kind {kind!r}")
    return KINDS[kind](settings, worker_name(settings.node_id))


def run_worker(kind: str, settings: Settings, redis_url: str) -> None:
    app = create_celery(settings, redis_url)
    spec = worker_kind(kind, settings)
    app.rollout_runtime_class = spec.runtime_class
    app.conf.worker_prefetch_multiplier = spec.prefetch()
    app.loader.import_default_modules()
    spec.configure(app)

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
        from workers.held_messages import celery_held_tags, start_held_message_sweep
        from workers.runtime import runtime

        rt = runtime(app)
        spec.start_sweeps(rt)
        # Messages a dead or cut-off worker of this kind held, back in seconds, not in an hour; its
        # heartbeat lists what it holds (a prefork worker's main process tracks its children's too).
        start_held_message_sweep(rt, kind, spec.tasks_held)
        start_heartbeat(rt.redis, kind, spec.worker, lambda: spec.status(rt, celery_held_tags(consumer)),
                        every_s=settings.heartbeat_seconds)

    @signals.worker_process_init.connect(weak=False)
    def on_pool_process_start(**_):
        # Sent in each prefork pool process (and once by the solo pool, in the main process).
        from workers.runtime import fresh_runtime

        spec.prepare_pool_process(fresh_runtime(app))  # a forked process must not use what its parent built

    @signals.worker_process_shutdown.connect(weak=False)
    @signals.worker_shutdown.connect(weak=False)
    def on_shutdown(**_):
        from workers.runtime import runtime

        rt = runtime(app)
        if "transport" in rt.__dict__:  # only a process that made handles owns transport memory
            rt.transport.close()

    from workers.runtime import runtime

    try:
        spec.before_consuming(runtime(app))
    except Exception:
        log.exception("the %s worker cannot serve; exiting without taking work", kind)
        logging.shutdown()
        os._exit(3)

    app.worker_main([
        "worker", "--queues", ",".join(spec.queues()), "--pool", spec.pool, "--concurrency", str(spec.concurrency()),
        "--hostname", f"{kind}-{os.getpid()}@{settings.node_id}", "--loglevel", settings.log_level,
        "--without-gossip", "--without-mingle",
    ])
