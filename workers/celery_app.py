"""The Celery app factory.

Queues and task names: ``domain.names``.

Reliability settings, and why:
- JSON only: tasks carry ids and small JSON, never pickled objects.
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a worker killed mid-task leaves its message
  unacknowledged, so Redis redelivers it. Every task is idempotent (the job store refuses to move a
  job backwards and a terminal job is left alone), which makes a redelivery harmless.
- ``visibility_timeout`` > ``task_time_limit``: Redis redelivers any message not acknowledged within
  the visibility timeout. If it were shorter than the longest a task may run, a slow job would be
  handed to a second worker while the first still runs it.
- The sweep that gives a dead worker's unacknowledged messages back (kombu's ``restore_visible``)
  runs every ``unacked_restore_interval`` seconds but scans only on every
  ``unacked_restore_throttle``-th run: kombu's defaults (10 s, every 10th) put ~100 s between
  scans, so a crashed worker's jobs would wait that long on top of the visibility timeout. We scan
  on every run, a few times per visibility timeout (a cheap ZRANGE on the unacked index).
- One sweep runs at a time fleet-wide, under a Redis lock that kombu holds for 300 s unless the
  sweep releases it. A sweep cut off by a Redis failover (or a killed worker) cannot release it, and
  the replica promoted in its place keeps it: nothing held was given back for five minutes. A sweep
  takes milliseconds, and two that overlap are safe (each restore is a WATCHed transaction on the
  unacked hash), so the lock lapses after three sweep intervals.
"""

from __future__ import annotations

from functools import cached_property

from celery import Celery
from kombu import Exchange, Queue

from domain.infra.intake_order import PRIORITY_STEPS
from domain.names import BATCHES_QUEUE, PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE, WEBHOOKS_QUEUE
from domain.redis_target import broker_options
from domain.settings import Settings
from workers.celery_transport import transport_for

TASK_MODULES = [
    "workers.tasks.cpu",
    "workers.tasks.render",
    "workers.tasks.gpu",
    "workers.tasks.webhooks",
    "workers.tasks.batches",
    "workers.tasks.score_lines",
]


class _NoResultsCelery(Celery):
    """Celery without results: the job record in Redis is the result. A backend would add a
    SUBSCRIBE/UNSUBSCRIBE round trip to every send_task for results nobody reads.

    Celery keeps its (disabled) backend per thread and builds it on a thread's first use, which
    scans the installed packages' entry points; ``send_task`` reaches it on every call (the
    ``AsyncResult`` it returns reads it). On a server that runs each request on a new thread that
    was ~10 % of a submit. The disabled backend holds no state, so one serves every thread. (Sending
    with ``ignore_result=True`` as well made celery-batches' worker stall now and then in
    ``tests/workers/tasks/test_gpu_batching.py``: left as Celery sends it.)"""

    @cached_property
    def backend(self):
        return self._get_backend()

    def send_task(self, *args, **kwargs):
        # Celery sends to our direct queues through the default exchange: kombu's Redis transport
        # then pushes onto the queue's list, which needs no declared binding. Declaring on every
        # send cost ~7 % of a submit (kombu copies the unbound queue before it consults its cache
        # of declared entities). tests/workers/test_celery_app.py sends into a Redis that never saw
        # the queue.
        kwargs.setdefault("declare", [])
        return super().send_task(*args, **kwargs)


def restore_interval(settings: Settings) -> int:
    """Seconds between sweeps that give back messages held past the visibility timeout."""
    return max(1, min(10, settings.visibility_timeout // 5))


def create_celery(settings: Settings, redis_url: str) -> Celery:
    broker, target_options = broker_options(redis_url)  # kombu's own Sentinel transport for a Sentinel target
    app = _NoResultsCelery("rollout_queue", broker=broker, include=TASK_MODULES)
    restore_every = restore_interval(settings)
    transport_options = {
        **target_options,
        "visibility_timeout": settings.visibility_timeout,
        "unacked_restore_interval": restore_every,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 3 * restore_every,
        # A list per step, the lowest taken first: generate messages are ordered between keys by
        # them (domain/infra/intake_order.py); every other message is at step 0.
        "priority_steps": list(PRIORITY_STEPS),
        # Publish again after Redis comes back instead of failing the API request outright.
        "max_retries": 3,
        "interval_start": 0,
        "interval_step": 0.2,
        "interval_max": 1,
    }
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_soft_time_limit=settings.task_soft_time_limit,
        task_time_limit=settings.task_time_limit,
        # kombu's Redis transport, taking many waiting messages per wake-up (workers/celery_transport.py).
        broker_transport=transport_for(broker),
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_ignore_result=True,
        task_default_queue=PREPROCESS_QUEUE,
        # Each queue has its own exchange and routing key: with one shared default exchange,
        # a message for one queue would be copied into every queue bound to the same key.
        task_queues=[_queue(name) for name in (PREPROCESS_QUEUE, settings.generate_queue, SHARED_GENERATE_QUEUE,
                                               WEBHOOKS_QUEUE, BATCHES_QUEUE)],
        worker_prefetch_multiplier=1,
        # A CPU worker's pool process loads the model's processor before it reports ready
        # (workers/worker_main.py); Celery's default allows 4 s.
        worker_proc_alive_timeout=60,
        worker_hijack_root_logger=False,
        # Task events cost a PUBLISH per message; they are for monitors like Flower (ROLLOUT_TASK_EVENTS).
        worker_send_task_events=settings.task_events,
        task_send_sent_event=settings.task_events,
        broker_pool_limit=10,
    )
    app.rollout_settings = settings
    app.rollout_redis_url = redis_url
    return app


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)
