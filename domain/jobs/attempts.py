"""Fenced attempts: only the newest run of a job writes its tokens, its end and its follow-ups.

A worker that only seems dead (a GC pause, a swap storm, a VM frozen past its heartbeat's TTL) has
its messages handed to another worker (``workers/held_messages.py``), which runs the job
again. When the first one wakes it must write nothing: its tokens would mix with the redo's on the
stream, and its end would make a record the stream never showed. So each run holds a number, and
every script that writes on a run's behalf checks it first (a fence):

- generation: ``rq:job:<id>:attempt``, counted up by the script that begins a GPU attempt
  (``JobEvents.begin_attempts``). The token writes (``JobEvents.publish_tokens``), the end
  (``JobStore`` transition, which also records the end's webhook and batch-line debts) and giving
  a job back to the queue (``JobEvents.release_attempts``) check it.
- preprocessing: ``rq:job:<id>:preprocess``, counted up as a CPU task starts on the job
  (``JobStore.claim_preprocessing``). Saving the finalized prompt, which a ``generate`` message
  follows, and failing the job check it (``JobStore.save_prompt_fenced``, the transition).

A counter that is gone (its TTL is the job's) fences nothing: no newer run can exist then.

Who holds a GPU attempt: ``rq:job:<id>:holder`` names the heartbeat key of the worker that began
the newest one. A worker that gets a message of a job whose holder is another worker, alive and
listing the job among those it runs (its heartbeat's ``running``), does not begin another attempt
(``workers/gpu/jobs.py`` ``open_jobs``): that message is a duplicate of one the holder runs, and
is settled. A holder gives its hold up before it sends a job back to the queue (a job
retracted by a weight update). A session that Redis' outage ended keeps its holds, but its next beat
lists none of their jobs; a message taken elsewhere before that beat is settled as a duplicate and
its job is sent again by the job reaper (``domain/jobs/reaper.py``) once it has stalled.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a fenced script returns where its run is not the newest (the job store's moves return it too).
FENCED = -2


def attempt_key(job_id: str) -> str:
    """The number of the job's newest generation attempt (1, 2, ...)."""
    return f"rq:job:{job_id}:attempt"


def holder_key(job_id: str) -> str:
    """The heartbeat key of the GPU worker that began the job's newest attempt."""
    return f"rq:job:{job_id}:holder"


def preprocess_key(job_id: str) -> str:
    """The number of the job's newest preprocessing run (1, 2, ...)."""
    return f"rq:job:{job_id}:preprocess"


@dataclass(frozen=True)
class Fence:
    """A run's number and the counter it must still equal for the run's writes to land."""

    key: str
    number: int

    @classmethod
    def generation(cls, job_id: str, attempt: int) -> Fence:
        return cls(attempt_key(job_id), attempt)

    @classmethod
    def preprocessing(cls, job_id: str, run: int) -> Fence:
        return cls(preprocess_key(job_id), run)


# Lua, statements: return {fenced} unless the counter at {key} is gone or equals {number} (a
# string ARGV; '' checks nothing).
FENCE_LUA = """
if {number} ~= '' then
  local newest = redis.call('GET', {key})
  if newest and newest ~= {number} then return {fenced} end
end
"""


def fence_lua(*, key: str, number: str, fenced: str = str(FENCED)) -> str:
    return FENCE_LUA.format(key=key, number=number, fenced=fenced)
