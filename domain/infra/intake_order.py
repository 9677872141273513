"""The GPU intake's order between keys: one key's backlog does not sit ahead of another key's message.

A GPU worker's scheduler is fair between keys over what it has reserved (its prefetch window, two
batches: engine/tenant_usage.py), but the generate queues behind that window were FIFO: key A's
1,000 messages sat ahead of key B's one, and B waited for all of them. So each generate message
gets a priority step at send from how deep its key is in the intake: the key's k-th message not
yet taken goes to step ``k // window`` (the window: a GPU worker's prefetch), the last step holding
everything deeper. kombu's Redis transport keeps a list per step and takes the lowest step first,
across all of a worker's queues (kombu's BRPOP and ``workers/celery_transport.py``'s burst take
alike), so every key's first window goes ahead of any key's deep backlog: B's message waits for at
most a window of each other key, then the worker's scheduler decides.

Why priorities rather than per-key sub-queues taken round-robin: kombu already keeps, takes,
restores (``restore_by_tag``, the visibility sweep, a rejected message) and measures priority
lists, each message carrying its step in its properties; sub-queues would need a take of our own in
every consumer and every reader of a queue to learn where a key's list lives. The cost of
priorities is only that whoever reads a queue's lists directly reads them all (:func:`queue_lists`).
Strict priority can hold a deep key's tail behind shallow keys that keep the fleet busy: that is the
point (the deep key still gets its first window at every step it reaches), and the worker's
scheduler shares the rows by recent use among whatever it reserved.

How deep a key is, without a count that can drift: each key's messages are numbered as they are
sent (``rq:intake:sent``, one HINCRBY for a whole bulk), each message carries its number (header
:data:`MARK_HEADER`), and the take script keeps the highest number taken per key
(``rq:intake:taken``). Depth at send = sent - highest taken - 1. A message restored, drained, lost
or sent again never needs a decrement, so nothing drifts: at worst depth is over- or
under-estimated by what other workers hold. Both hashes lapse after :data:`COUNTS_TTL_S` of no
sends or takes; a number taken beyond the key's sent count (from before a lapse) is ignored.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence

import redis
from kombu.transport.redis import Channel

log = logging.getLogger(__name__)

# kombu's Redis priority steps (transport option ``priority_steps``): a list per step, the queue's
# own name for step 0, ``<queue>\x06\x16<step>`` for the rest; the lowest step is taken first.
PRIORITY_STEPS = tuple(range(10))
SENT_KEY = "rq:intake:sent"  # key -> how many generate messages it has sent (numbered from 1)
TAKEN_KEY = "rq:intake:taken"  # key -> the highest of its numbers a worker has taken
MARK_HEADER = "rq_intake"  # a generate message's [key, number]
COUNTS_TTL_S = 86_400


def queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold a queue's waiting messages, highest priority first (kombu's names)."""
    return [queue if step == 0 else f"{queue}{Channel.sep}{step}" for step in PRIORITY_STEPS]


def all_lists(queues: Iterable[str]) -> list[str]:
    return [name for queue in queues for name in queue_lists(queue)]


def waiting(client: redis.Redis, queues: Sequence[str]) -> list[int]:
    """Each queue's waiting messages (all its lists), in one round trip."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        for name in queue_lists(queue):
            pipe.llen(name)
    lengths = pipe.execute()
    per = len(PRIORITY_STEPS)
    return [sum(lengths[i * per:(i + 1) * per]) for i in range(len(queues))]


def step_for(depth: int, window: int) -> int:
    """The priority step of a key's message with ``depth`` of its messages queued ahead of it."""
    return min(max(depth, 0) // max(window, 1), PRIORITY_STEPS[-1])


def intake_marks(client: redis.Redis, owners: Sequence[str], *, window: int) -> list[tuple[int, list] | None]:
    """For each message to send (``owners[i]``: its key, in send order), its priority step and the
    mark it carries (``[key, number]``), numbered in one round trip. None for each when Redis refuses
    (at its bound, or away): they go at step 0 unnumbered, and their publish meets the same refusal."""
    if not owners:
        return []
    counts = Counter(owners)
    keys = list(counts)
    pipe = client.pipeline(transaction=False)
    for owner in keys:
        pipe.hincrby(SENT_KEY, owner, counts[owner])
    pipe.hmget(TAKEN_KEY, keys)
    pipe.expire(SENT_KEY, COUNTS_TTL_S)
    pipe.expire(TAKEN_KEY, COUNTS_TTL_S)
    try:
        replies = pipe.execute()
    except redis.RedisError as error:
        log.warning("generate messages sent unranked (%s)", error.__class__.__name__)
        return [None] * len(owners)
    sent = dict(zip(keys, replies[:len(keys)], strict=True))
    taken = {owner: int(raw or 0) for owner, raw in zip(keys, replies[len(keys)], strict=True)}
    following = {owner: sent[owner] - counts[owner] + 1 for owner in keys}
    marks: list[tuple[int, list] | None] = []
    for owner in owners:
        number = following[owner]
        following[owner] += 1
        marks.append((step_for(number - taken[owner] - 1, window), [owner, number]))
    return marks
