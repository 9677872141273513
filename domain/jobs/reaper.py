"""Jobs that no message carries any more, found and queued again (how: ``domain/infra/lost_messages.py``).

A few crashes leave an unfinished job with no message to run it:

- kombu's Redis transport pops a message (BRPOP) before it records it as unacknowledged: a worker
  or Redis killed in between loses it;
- an API process killed between storing a job and publishing its first message.

The job store indexes every unfinished job by its last move (``JobStore.stalled``). Jobs that have
not moved for ``stall_s`` seconds (``ROLLOUT_STALLED_JOB_AFTER``) are looked for in the job queues
(the node queue their stored prompt names), kombu's unacknowledged messages and the CPU fair
share's parked and waking entries. One lost gets its next message again: ``generate`` when its
finalized prompt is stored, ``preprocess`` otherwise.

A worker killed while it takes messages is often inside that window (killed so in a test here,
one kill in three lost a message): a busy worker's main thread waits for the GIL between Redis'
pop and its record. So the moment a CPU or GPU worker's heartbeat is gone, every unfinished job is
looked for, stalled or not, for a few sweeps a heartbeat apart (:class:`AfterDeathReaper`): what
the dead worker popped runs again seconds later, not ``stall_s`` later.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any

import redis

from domain.infra.gpu_affinity import DirectQueueDrain, direct_queues
from domain.infra.heartbeats import vanished
from domain.infra.lost_messages import Suspects, ids_in_messages, start_sweeping, sweep_every
from domain.jobs.store import TERMINAL
from domain.jobs.submission import enqueue_preprocess, send_generate
from domain.names import PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE, node_generate_queue

log = logging.getLogger(__name__)

# Job ids (domain.jobs.store.new_id) as they appear in a message's headers (``argsrepr``).
_JOB_ID = re.compile(rb"job_[A-Za-z0-9_-]{22}")
SUSPECTS_KEY = "rq:reaper:suspects"  # the stalled jobs the last sweep found no message for
AFTER_DEATH_SUSPECTS_KEY = "rq:reaper:after-death:suspects"
WORKERS_SEEN_KEY = "rq:reaper:after-death:seen"  # the CPU and GPU heartbeats live at the last look
AFTER_DEATH_KEY = "rq:reaper:after-death:left"  # the sweeps still owed to the last death
# Sweeps after a death: the second confirms what the first missed; two more for a message a
# restore or a redelivery moved under the first reads.
AFTER_DEATH_SWEEPS = 4
MAX_CANDIDATES = 1000  # per sweep; the oldest first, so a long backlog is worked through in turns


class JobReaper:
    """``rt``: a worker's runtime (``jobs``, ``redis``, ``celery``, ``share``)."""

    def __init__(self, rt, *, stall_s: float, suspects_key: str = SUSPECTS_KEY):
        self.rt = rt
        self.redis: redis.Redis = rt.redis
        self.stall_s = stall_s
        self.suspects = Suspects(rt.redis, suspects_key, ttl=int(stall_s + 600))

    def sweep(self) -> list[str]:
        """One sweep; the ids of the jobs queued again."""
        jobs = self.rt.jobs
        candidates = jobs.stalled(before=time.time() - self.stall_s, limit=MAX_CANDIDATES)
        if not candidates:
            self.suspects.clear()
            return []
        records = dict(zip(candidates, jobs.get_many(candidates), strict=True))
        jobs.forget_unfinished([job_id for job_id, job in records.items()
                                if job is None or job["status"] in TERMINAL])
        live = [job_id for job_id, job in records.items() if job is not None and job["status"] not in TERMINAL]
        prompts = {job_id: json.loads(raw) for job_id, raw in zip(live, jobs.prompts(live), strict=True)
                   if raw is not None}
        node_queues = {_generate_queue(prompt) for prompt in prompts.values()} - {SHARED_GENERATE_QUEUE}
        carried = ids_in_messages(self.redis, _JOB_ID, parked=self.rt.share("cpu").entries(),
                                  queues=(PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE, *sorted(node_queues),
                                          *sorted(direct_queues(self.redis))))
        missing = [job_id for job_id in live if job_id not in carried]
        lost = self.suspects.confirm(missing)
        for job_id in lost:
            self._send_again(records[job_id], prompts.get(job_id))
        # The new suspects keep their place: the next sweep must look at them again.
        suspected = set(missing) - set(lost)
        jobs.reset_stall([job_id for job_id in live if job_id not in suspected])
        if lost:
            log.warning("%d jobs no message carried were queued again: %s", len(lost), ", ".join(lost))
        return lost

    def _send_again(self, job: dict[str, Any], prompt: dict[str, Any] | None) -> None:
        if prompt is not None:
            send_generate(self.rt.celery, job["id"], queue=_generate_queue(prompt))
        else:
            # A generating job without its prompt gets it made again on this node (see tasks/cpu.py).
            enqueue_preprocess(self.rt.celery, job["id"], retry_handles=job["status"] == "generating")


def _generate_queue(prompt: dict[str, Any]) -> str:
    # Handles name memory on the node that made them: only that node's GPU workers may open them.
    return SHARED_GENERATE_QUEUE if prompt["transport"] == "inline" else node_generate_queue(prompt["node_id"])


class AfterDeathReaper:
    """Every unfinished job looked for, for :data:`AFTER_DEATH_SWEEPS` sweeps once a CPU or GPU
    worker's heartbeat is gone (its own suspects: the stalled-jobs sweep keeps its own)."""

    def __init__(self, rt):
        self.redis: redis.Redis = rt.redis
        self.reaper = JobReaper(rt, stall_s=0, suspects_key=AFTER_DEATH_SUSPECTS_KEY)

    def sweep(self) -> list[str]:
        if dead := vanished(self.redis, ("cpu", "gpu"), WORKERS_SEEN_KEY):
            log.info("worker heartbeats gone (%s): looking for every unfinished job's message", ", ".join(sorted(dead)))
            self.redis.set(AFTER_DEATH_KEY, AFTER_DEATH_SWEEPS, ex=60)
        left = int(self.redis.get(AFTER_DEATH_KEY) or 0)
        if left <= 0:
            return []
        self.redis.set(AFTER_DEATH_KEY, left - 1, ex=60)
        lost = self.reaper.sweep()
        if left == 1:
            self.reaper.suspects.clear()  # what the last sweep missed waits for the next death or the stall
        return lost


def start_reaper(rt, *, stall_s: float) -> threading.Event:
    """Sweep in a daemon thread, at most once per interval across all workers, until the event is set."""
    reaper = JobReaper(rt, stall_s=stall_s)
    return start_sweeping(rt.redis, "jobs", reaper.sweep, every_s=sweep_every(stall_s))


def send_generate_again(rt, job_ids: list[str], step: int = 0) -> None:
    """Each job's generate message again, to its node's queue or the shared one, at priority
    ``step`` (what waited in a GPU worker's own queue, at that step, when the worker went away)."""
    jobs = rt.jobs
    for job_id, raw in zip(job_ids, jobs.prompts(job_ids), strict=True):
        if raw is not None:
            send_generate(rt.celery, job_id, queue=_generate_queue(json.loads(raw)), step=step)


def start_direct_queue_drain(rt) -> threading.Event:
    """:class:`domain.infra.gpu_affinity.DirectQueueDrain`, a heartbeat apart, in one worker at a time."""
    drain = DirectQueueDrain(rt.redis, lambda job_ids, step: send_generate_again(rt, job_ids, step), _JOB_ID)
    return start_sweeping(rt.redis, "direct-queues", drain.sweep, every_s=rt.settings.heartbeat_seconds)


def start_after_death_reaper(rt) -> threading.Event:
    """:class:`AfterDeathReaper`, a heartbeat apart, in one worker at a time."""
    return start_sweeping(rt.redis, "jobs-after-death", AfterDeathReaper(rt).sweep,
                          every_s=rt.settings.heartbeat_seconds)
