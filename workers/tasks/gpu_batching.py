"""How the GPU worker gathers ``rollout.generate`` messages into engine batches.

celery-batches buffers the messages the worker reserves and hands a list of them to the pool; we
use it rather than a scheduler of our own because the messages are already in Celery. Ours are
the pool it runs on, the rule for when to flush, and surviving a lost broker connection.

The pool: one thread (``--pool threads --concurrency 1``). The batch runs in that thread while
the main thread's event loop goes on reading messages. Why not the solo pool, which ran the batch
in the event loop's own thread:

- kombu's Redis transport pops a message (BRPOP) before it records it as unacknowledged. With the
  event loop blocked by a batch, a message Redis had already handed over sat unread in the socket
  for the whole batch, and a SIGKILL then lost it for good. Read at once, that window is a few
  microseconds.
- The next batch is reserved and decoded while this one runs: the engine does not wait on Redis.
- CPython 3.11 frees a frame-stack chunk as soon as the frame at its base returns. Under Celery's
  ~30 frames of event loop, the model's forward crossed a chunk boundary hundreds of times per
  batch, each crossing an mmap, page faults and a munmap: generation ran 25% slower than the same
  engine in a plain script. A pool thread starts from a shallow stack.

The flush rule:

- while a batch runs, hold: what arrives meanwhile is the next batch, and the pool thread starts
  it the moment the running one ends (the worker's prefetch is twice the batch size, so a full next
  batch can be reserved meanwhile). The event loop does not tick then: every tick takes the GIL
  from the model's thread, and 1 ms ticks slowed generation by a quarter.
- when idle, on every tick (``flush_interval``) and arriving message: flush a full batch at once.
  Hold a partial one while more jobs wait in this worker's queues in Redis, for at most
  ``max_wait``; otherwise flush it now. celery-batches' own rule flushes whatever arrived on every
  tick, and one message arrives per Redis round trip: 64 waiting jobs ran as batches of ~5.

Continuous batching: the batch the pool thread runs is a session of the engine's scheduler
(``workers/gpu/session.py``), not one static batch. Between decode steps the session takes more
messages from the buffer (:meth:`GenerateBatches.take`, as many as it has free rows) and
acknowledges the messages of the jobs that ended, a step's all in one round trip
(:meth:`GenerateBatches.acknowledge`, ``workers/gpu/bulk_ack.py``); what the session
leaves unacknowledged (Redis went away, or a crash) is settled when it returns, as before.

``rollout.generate`` messages never carry an ETA, so celery-batches' ETA queue (``_pending``) is
not consulted.
"""

from __future__ import annotations

import threading
import time

from celery_batches import Batches, SimpleRequest
from celery_batches.trace import apply_batches_task

from domain.infra.intake_order import waiting
from domain.infra.redis_client import REDIS_DOWN
from domain.names import SHARED_GENERATE_QUEUE
from workers.gpu.bulk_ack import acknowledge_messages
from workers.gpu.requeue import REQUEUE
from workers.runtime import runtime


class GenerateBatches(Batches):
    #: Longest a partial batch is held while more jobs wait in this worker's queues (seconds).
    max_wait = 0.02
    #: The generate queues this worker consumes (its node's, the shared one, its own).
    queues: tuple[str, ...] = ()
    _oldest_buffered = 0.0
    # The event loop (ticks) and the pool thread (a batch ending) both start batches; ``_running``
    # changes only under the lock, so a message that arrives as a batch ends is never left waiting.
    # Reentrant: on the solo pool a batch, and so its end, runs inside the tick that started it.
    _lock = threading.RLock()
    _running = False

    def Strategy(self, task, app, consumer):
        """celery-batches starts its flush timer once and remembers it in ``_tref``. When the
        connection to Redis drops, Celery clears the event loop's timers and restarts the consumer,
        which builds the strategy again: forget the dead timer here and tick again for what the old
        connection left in the buffer (otherwise those jobs would hang in ``generating``)."""
        handler = super().Strategy(task, app, consumer)
        self._consumer = consumer
        self._tref = None
        if not self._buffer.empty():
            self._tref = consumer.timer.call_repeatedly(self.flush_interval, self._do_flush)

        def buffer_request(*args, **kwargs):
            if self._buffer.empty():
                self._oldest_buffered = time.monotonic()
            return handler(*args, **kwargs)

        return buffer_request

    def _do_flush(self) -> None:
        """The event loop's tick."""
        with self._lock:
            if self._buffer.empty() or self._running:
                # Nothing to decide until a message arrives (it starts the timer again) or the
                # running batch ends (it starts the next one itself).
                if self._tref is not None:
                    self._tref.cancel()
                    self._tref = None
                return
            if (self._buffer.qsize() < self.flush_every and time.monotonic() - self._oldest_buffered < self.max_wait
                    and self._more_queued()):
                return
            self._start_next_batch()

    def _after_batch(self) -> None:
        """In the pool thread, once a batch is acknowledged: what arrived meanwhile runs now."""
        with self._lock:
            self._running = False
            if not self._buffer.empty():
                self._start_next_batch()

    def _start_next_batch(self) -> None:
        requests = [self._buffer.get_nowait() for _ in range(min(self._buffer.qsize(), self.flush_every))]
        self._oldest_buffered = time.monotonic()  # for the requests left over, if any
        self._running = True
        self.flush(requests)

    def _more_queued(self) -> bool:
        rt = runtime(self.app)
        try:
            return sum(waiting(rt.redis, self.queues or (rt.settings.generate_queue, SHARED_GENERATE_QUEUE))) > 0
        except REDIS_DOWN:
            return False

    @property
    def _inflight(self) -> dict:
        """Messages handed to the running session and not yet settled, by request id."""
        return self.__dict__.setdefault("_inflight_requests", {})

    def held_delivery_tags(self) -> list[str]:
        """The delivery tags of every message this worker holds unsettled (buffered, or taken by the
        running session): what its heartbeat reports (``workers/held_messages.py``). Read from the
        heartbeat thread: the buffer under its own mutex, the in-flight map as one atomic copy."""
        with self._buffer.mutex:
            buffered = list(self._buffer.queue)
        requests = buffered + list(self._inflight.copy().values())
        return [str(request.message.delivery_tag) for request in requests if request.message is not None]

    def running_job_ids(self) -> list[str]:
        """The jobs of the messages the running session took and has not settled: what its
        heartbeat lists as running (``domain/jobs/attempts.py``). Read from the heartbeat thread."""
        return sorted({request.args[0] for request in self._inflight.copy().values() if request.args})

    def take(self, limit: int) -> list[SimpleRequest]:
        """In the pool thread, between decode steps: up to ``limit`` buffered messages join the
        running session (acknowledged later, one by one, as their jobs end)."""
        with self._lock:
            requests = [self._buffer.get_nowait() for _ in range(min(self._buffer.qsize(), max(limit, 0)))]
            for request in requests:
                self._inflight[request.id] = request
        for request in requests:
            if not request.task.acks_late:
                request.acknowledge()
        return [SimpleRequest.from_request(request) for request in requests]

    def acknowledge(self, request_ids) -> None:
        """The jobs of these messages ended (their results are stored): the messages are done, all
        in one round trip."""
        requests = [self._inflight.pop(request_id, None) for request_id in request_ids]
        self._acknowledge([request for request in requests if request is not None and request.task.acks_late])

    def hand_back(self, request_ids) -> None:
        """These messages' jobs go back to the queue unfailed (Redis refused a write for memory):
        rejected with requeue; one Redis refuses to put back is left to the held-message sweep
        (``workers/celery_transport.py``)."""
        requests = [self._inflight.pop(request_id, None) for request_id in request_ids]
        for request in requests:
            if request is not None and request.task.acks_late:
                request.reject(requeue=True)

    def _acknowledge(self, requests) -> None:
        """``Request.acknowledge`` for many requests, their messages settled in one round trip. As
        Celery's own acks, it runs on the event loop (``call_soon``): that loop then reserves the
        next messages at once, where an ack from this thread would leave it asleep until its next
        timer with the prefetch window full."""
        messages = [request.message for request in requests if not request.acknowledged]
        for request in requests:
            request.acknowledged = True
        if messages:
            self._consumer.call_soon(acknowledge_messages, messages)

    def flush(self, requests):
        """As ``Batches.flush``, with two changes. A batch that returns ``REQUEUE`` (Redis went away
        under it) puts its messages back instead of acknowledging them: an ack that lands once Redis
        is back would leave those jobs unfinished for good. And the end of a batch starts the next
        (the pool calls ``on_return`` whatever the batch did; celery-batches' trace catches its
        exceptions)."""
        acks_early = [request for request in requests if not request.task.acks_late]
        for request in requests:
            self._inflight[request.id] = request

        def on_accepted(pid, time_accepted) -> None:
            for request in acks_early:
                request.acknowledge()

        def on_return(result) -> None:
            try:
                # What the session did not settle: every message it took, not only these.
                left = [request for request in self._inflight.values() if request.task.acks_late]
                self._inflight.clear()
                if result == REQUEUE:
                    for request in left:
                        request.reject(requeue=True)
                else:
                    self._acknowledge(left)
            finally:
                self._after_batch()

        return self._pool.apply_async(
            apply_batches_task, (self, ([SimpleRequest.from_request(r) for r in requests],), 0, None),
            accept_callback=on_accepted, callback=on_return,
        )
