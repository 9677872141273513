"""Jobs that no message carries any more, found and queued again.

Every unfinished job is carried by a message: in a queue, held unacknowledged by a worker (kombu's
``unacked`` hash), or parked or being woken by a fair share (``workers/fair_share.py``). A few
crashes leave a job with none, and nothing would ever run it again:

- kombu's Redis transport pops a message (BRPOP) before it records it as unacknowledged: a worker
  or Redis killed in between loses it;
- Redis killed with ``appendfsync everysec`` loses its last second of writes, which may hold such a
  pop and not the record that followed it;
- an API process killed between storing a job and publishing its first message.

The sweep: the job store indexes every unfinished job by its last move (``JobStore.stalled``).
Jobs that have not moved for ``stall_s`` seconds (the visibility timeout: kombu itself gives a
dead worker's message back no sooner) are looked for in every carrier. A job found in none twice
in a row, a sweep apart (the pop-before-record gap lasts milliseconds), gets its next message
again: ``generate`` when its finalized prompt is stored, ``preprocess`` otherwise. Every task is
idempotent, so a duplicate that slips through costs a no-op. One sweep runs per interval across
all workers (a lock in Redis that expires by itself).

Written here because neither Celery nor kombu reconciles what an application expects to run with
what the broker holds.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any

import redis
from kombu.transport.redis import Channel

from workers.job_store import TERMINAL
from workers.names import GENERATE_TASK, PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE, node_generate_queue
from workers.submission import enqueue_preprocess

log = logging.getLogger(__name__)

# Job ids (workers.job_store.new_id) as they appear in a message's headers (``argsrepr``).
_JOB_ID = re.compile(rb"job_[A-Za-z0-9_-]{22}")
SUSPECTS_KEY = "rq:reaper:suspects"  # the stalled jobs the last sweep found no message for
LOCK_KEY = "rq:reaper:lock"
MAX_CANDIDATES = 1000  # per sweep; the oldest first, so a long backlog is worked through in turns
_PAGE = 1000  # queue entries read per round trip


def sweep_every(stall_s: float) -> float:
    """Seconds between sweeps: a few per stall period, at least one second and at most a minute."""
    return min(max(stall_s / 10, 1.0), 60.0)


class JobReaper:
    """``rt``: a worker's runtime (``jobs``, ``redis``, ``celery``, ``share``)."""

    def __init__(self, rt, *, stall_s: float):
        self.rt = rt
        self.redis: redis.Redis = rt.redis
        self.stall_s = stall_s

    def sweep(self) -> list[str]:
        """One sweep; the ids of the jobs queued again."""
        jobs = self.rt.jobs
        candidates = jobs.stalled(before=time.time() - self.stall_s, limit=MAX_CANDIDATES)
        if not candidates:
            self.redis.delete(SUSPECTS_KEY)
            return []
        records = dict(zip(candidates, jobs.get_many(candidates), strict=True))
        jobs.forget_unfinished([job_id for job_id, job in records.items()
                                if job is None or job["status"] in TERMINAL])
        live = [job_id for job_id, job in records.items() if job is not None and job["status"] not in TERMINAL]
        prompts = {job_id: json.loads(raw) for job_id, raw in zip(live, jobs.prompts(live), strict=True)
                   if raw is not None}
        carried = self._carried({_generate_queue(prompt) for prompt in prompts.values()})
        missing = [job_id for job_id in live if job_id not in carried]
        suspects = {member.decode() for member in self.redis.smembers(SUSPECTS_KEY)}
        lost = [job_id for job_id in missing if job_id in suspects]
        pipe = self.redis.pipeline()
        pipe.delete(SUSPECTS_KEY)
        if suspected := [job_id for job_id in missing if job_id not in suspects]:
            pipe.sadd(SUSPECTS_KEY, *suspected)
            pipe.expire(SUSPECTS_KEY, int(self.stall_s + 600))
        pipe.execute()
        for job_id in lost:
            self._send_again(records[job_id], prompts.get(job_id))
        jobs.mark_moved(lost)
        if lost:
            log.warning("%d jobs no message carried were queued again: %s", len(lost), ", ".join(lost))
        return lost

    def _carried(self, node_queues: set[str]) -> set[str]:
        """The job ids some message names now. Read in the order messages flow (parked, waking,
        queued, unacknowledged), so one that moves on during the read is seen where it arrives."""
        found: set[bytes] = set()
        for entry in self.rt.share("cpu").entries():
            found.update(_JOB_ID.findall(entry))
        for queue in (PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE, *sorted(node_queues - {SHARED_GENERATE_QUEUE})):
            start = 0
            while page := self.redis.lrange(queue, start, start + _PAGE - 1):
                for message in page:
                    found.update(_JOB_ID.findall(message))
                start += _PAGE
        for _, message in self.redis.hscan_iter(Channel.unacked_key, count=_PAGE):
            found.update(_JOB_ID.findall(message))
        return {job_id.decode() for job_id in found}

    def _send_again(self, job: dict[str, Any], prompt: dict[str, Any] | None) -> None:
        if prompt is not None:
            self.rt.celery.send_task(GENERATE_TASK, args=[job["id"]], queue=_generate_queue(prompt))
        else:
            # A generating job without its prompt gets it made again on this node (see tasks/cpu.py).
            enqueue_preprocess(self.rt.celery, job["id"], retry_handles=job["status"] == "generating")


def _generate_queue(prompt: dict[str, Any]) -> str:
    # Handles name memory on the node that made them: only that node's GPU workers may open them.
    return SHARED_GENERATE_QUEUE if prompt["transport"] == "inline" else node_generate_queue(prompt["node_id"])


def start_reaper(rt, *, stall_s: float) -> threading.Event:
    """Sweep in a daemon thread, at most once per interval across all workers, until the event is set."""
    reaper, every_s, stop = JobReaper(rt, stall_s=stall_s), sweep_every(stall_s), threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                # Whoever takes the lock sweeps; it lapses by itself, so sweeps stay an interval apart.
                if reaper.redis.set(LOCK_KEY, 1, nx=True, px=int(every_s * 1000)):
                    reaper.sweep()
            except redis.RedisError:
                pass  # Redis is away: the next sweep tries again
            except Exception:
                log.exception("job reaper: sweep failed")

    threading.Thread(target=loop, name="job-reaper", daemon=True).start()
    return stop
