"""Which GPU worker a ``generate`` message goes to: the one that already holds its prompt's prefix.

Each GPU worker keeps the KV blocks it computed (``engine/paged_kv.py``), so a prompt that starts
like one it served recently prefills only what is new there (a GRPO group's samples, an agent's
next turn, a batch's lines with one prompt). Spread over the node queue instead, a group's samples
landed on every worker and each prefilled and encoded the prompt itself.

How a message finds its worker:

- Each GPU worker consumes a queue of its own, ``generate.gpu.<worker>`` (``domain.names``),
  beside its node's queue and the shared one; its heartbeat names it.
- A prompt is named by a chain of hashes, one per :data:`PREFIX_STEP` tokens and one for the whole
  prompt, over the caller's cache scope (key and ``cache_salt``: two keys never share blocks, so
  they need not share a worker), its tokens and the content hashes of its media.
- A small index in Redis, ``rq:affinity:route:<hash>`` -> worker queue (:data:`ROUTE_TTL_S`), says
  where a prompt's prefixes went last: a few of them, :func:`noted_depths` (the whole prompt, its
  last whole step, and depths shrinking by :data:`NOTE_RATIO`: 11 keys for 2,000 tokens, 16 for
  8,000, where a key per step made 32 and 125). A prompt goes where its deepest routed prefix
  went, if that worker lives and the prefix is at least :data:`MATCH_THRESHOLD` of the prompt (an
  agent's next turn, a group's next sample); otherwise it starts a new prefix on the first worker,
  in rendezvous order (highest random weight) over the live workers for the whole prompt, that has
  started no more than :data:`GROUP_BOUND` times its even share of new prefixes in the last minute
  or two (``rq:affinity:groups:<window>``): prompts that share only a system prompt still spread, a burst
  of groups spreads evenly, and a prompt keeps its worker while others come and go. This is
  SGLang's cache-aware router (an approximate radix tree of what each worker was sent, its
  ``cache_threshold``) kept in Redis, so every API process and CPU worker routes alike, with
  consistent hashing with bounded loads for what is new.
- A prompt that names its session (an agent's turns: SkyRL's ``X-Session-ID``, a native
  ``session_id``) follows the session's worker, ``rq:affinity:session:<hash>`` (the scope and the
  session id hashed), whatever it shares with the last turn: a turn whose history was cut or
  summarized keeps the worker that holds the rest of what the agent sent.
- Load comes first when a worker is far busier than the least loaded one (the messages its
  heartbeat says it holds plus its queue's length; more than twice as many and
  :data:`BALANCE_MIN_GAP` more): the message goes to the least loaded worker, as that router's
  balance thresholds do.
- Items with feature handles choose among their node's workers only. With no live GPU worker to
  choose (none up yet), a message goes to its node or the shared queue, as before.
- A worker that dies or leaves: :class:`DirectQueueDrain` moves the messages left in its queue to
  its node's queue (or the shared one) within a sweep, each at the priority step it had
  (``domain/infra/intake_order.py``); what it held is restored to its queue by the held-message
  sweep and moved on the same way.

Celery's routing is by queue name (each queue its own direct exchange, ``workers/celery_app.py``),
so a direct queue is an ordinary Celery queue: no broker of our own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from domain.infra.heartbeats import indexed, live
from domain.infra.intake_order import PRIORITY_STEPS, queue_lists, waiting
from domain.names import SHARED_GENERATE_QUEUE, direct_queue, node_generate_queue

log = logging.getLogger(__name__)

PREFIX_STEP = 64  # tokens per named prefix: a few KV blocks
ROUTE_TTL_S = 900  # a prefix's route outlives a long agent turn, not a worker's cache
BALANCE_MIN_GAP = 64  # messages: a typical GPU batch; below it, a worker is never "far busier"
MATCH_THRESHOLD = 0.5  # of a prompt's prefixes, routed before, to follow them
# Routes are noted at depths shrinking by this factor below a prompt's last whole step: a later
# prompt that shares at least MATCH_THRESHOLD / NOTE_RATIO (2/3) of itself with one still finds it.
NOTE_RATIO = 0.75
GROUP_BOUND = 1.25  # a worker takes a new prefix while it has started at most this x the even share
GROUP_WINDOW_S = 60  # new prefixes are counted per window; the last two count
LIVE_REFRESH_S = 1.0  # how stale the list of live workers may be in one process
_ROUTE_KEY = "rq:affinity:route:"
_SESSION_KEY = "rq:affinity:session:"
_GROUPS_KEY = "rq:affinity:groups:"  # per window: queue -> new prefixes sent to it
DIRECT_QUEUES_KEY = "rq:affinity:queues"  # hash: direct queue -> {worker, registered at} (the drain's list)
# A queue registered this recently, whose worker never beat, is not drained: it may be starting.
REGISTERED_GRACE_S = 30.0


@dataclass(frozen=True)
class Placement:
    """One generate message to place: its prompt, as the engine will see it."""

    job_id: str
    token_ids: Sequence[int]
    scope: str  # the caller's cache scope: blocks are never shared across scopes
    media: Sequence[tuple[int, str]] = ()  # (offset, content hash) of each item
    node: str | None = None  # the node that holds its feature handles; None: inline, any node
    session: str | None = None  # the caller's session id: its prompts stay on one worker
    owner: str = ""  # the caller's key: its place in the intake (domain/infra/intake_order.py)

    @property
    def session_key(self) -> str | None:
        """Its session's route (the scope in the hash: two keys' sessions never meet)."""
        if self.session is None:
            return None
        return _SESSION_KEY + hashlib.blake2b(f"{self.scope}\x1f{self.session}".encode(), digest_size=16).hexdigest()

    @property
    def fallback_queue(self) -> str:
        return node_generate_queue(self.node) if self.node else SHARED_GENERATE_QUEUE


@dataclass
class Worker:
    queue: str
    node: str
    load: int  # messages it holds or has waiting
    groups: int = 0  # new prefixes sent to it lately (this minute and the last)


def prefix_hashes(scope: str, token_ids: Sequence[int], media: Sequence[tuple[int, str]] = (),
                  step: int = PREFIX_STEP) -> list[str]:
    """The prompt's prefixes named, shortest first: one per ``step`` tokens, then the whole prompt
    (when it does not end on a step). Each hash chains its prefix's, so equal names mean equal
    prefixes; a medium's content hash joins the piece that holds its first placeholder."""
    names, digest = [], hashlib.blake2b(scope.encode(), digest_size=16).digest()
    by_piece: dict[int, list[str]] = {}
    for offset, content_hash in media:
        by_piece.setdefault(offset // step, []).append(content_hash)
    for piece, start in enumerate(range(0, len(token_ids), step)):
        chunk = token_ids[start:start + step]
        h = hashlib.blake2b(digest, digest_size=16)
        h.update(json.dumps([list(chunk), by_piece.get(piece, [])]).encode())
        digest = h.digest()
        names.append(digest.hex())
    return names


def noted_depths(count: int) -> list[int]:
    """Which of a prompt's ``count`` prefixes (depths, 1 = the first step) get a route, deepest
    first: the whole prompt (a group's samples, a batch's lines), its last whole step (an agent's
    next turn shares that, not the tail it extends), then each depth :data:`NOTE_RATIO` of the one
    before, down to 1. A key per step made a 2,000-token prompt 32 keys (about 5.8 KB of Redis) for
    :data:`ROUTE_TTL_S`; this is logarithmic in the prompt's length."""
    depths = [count] if count else []
    depth = count - 1
    while depth >= 1:
        depths.append(depth)
        depth = min(depth - 1, int(depth * NOTE_RATIO))
    return depths


def rendezvous_order(key: str, queues: Sequence[str]) -> list[str]:
    """Highest random weight first: the queues by their hash with ``key``. A key keeps its first
    queue while others are added or removed; only the keys of a queue that leaves move."""
    return sorted(queues, key=lambda q: hashlib.blake2b(f"{key}|{q}".encode(), digest_size=8).digest(), reverse=True)


def choose(names: Sequence[str], routed: Sequence[str | None], workers: Sequence[Worker],
           session: str | None = None) -> tuple[Worker, bool]:
    """Where a prompt goes (pure; see the module docstring), and whether it starts a new prefix
    there: its session's worker (``session``, a queue) when that lives; the live worker of its
    deepest routed prefix when that covers enough of it; else the
    first worker in rendezvous order over the whole prompt that has started at most
    :data:`GROUP_BOUND` times the even number of new prefixes lately (consistent hashing with
    bounded loads: a burst of groups spreads evenly, each still keeping its
    worker); the least loaded one instead when that worker is far busier."""
    by_queue = {w.queue: w for w in workers}
    depth = next((i + 1 for i in reversed(range(len(routed))) if routed[i] in by_queue), 0)
    new = not (depth and depth >= MATCH_THRESHOLD * len(names))
    if session in by_queue:
        chosen, new = by_queue[session], False
    elif new:
        bound = math.ceil(GROUP_BOUND * (sum(w.groups for w in workers) + 1) / len(workers))
        order = rendezvous_order(names[-1] if names else "", list(by_queue))
        chosen = next(by_queue[q] for q in order if by_queue[q].groups < bound)
    else:
        chosen = by_queue[routed[depth - 1]]
    least = min(workers, key=lambda w: (w.load, w.queue))
    if chosen.load > 2 * least.load and chosen.load - least.load >= BALANCE_MIN_GAP:
        return least, True
    return chosen, new


@dataclass
class GpuRouter:
    """Places generate messages on GPU workers' own queues: one Redis round trip to look (the live
    workers themselves are read at most every :data:`LIVE_REFRESH_S`), and one to note the routes
    when something new was routed, for any number of messages."""

    client: redis.Redis

    def queues(self, placements: Sequence[Placement]) -> list[str]:
        if not placements:
            return []
        statuses = _live_statuses(self.client)
        if not statuses:
            return [p.fallback_queue for p in placements]
        named = [prefix_hashes(p.scope, p.token_ids, p.media) for p in placements]
        keys = [_ROUTE_KEY + name for names in named for name in names]
        sessions = [p.session_key for p in placements if p.session_key is not None]
        window = int(time.time() // GROUP_WINDOW_S)
        pipe = self.client.pipeline(transaction=False)
        pipe.mget(keys + sessions)
        pipe.hgetall(f"{_GROUPS_KEY}{window}")
        pipe.hgetall(f"{_GROUPS_KEY}{window - 1}")
        for name in (name for status in statuses for name in queue_lists(status["direct_queue"])):
            pipe.llen(name)
        routed_raw, *recent = pipe.execute()
        per = len(PRIORITY_STEPS)
        recent, lengths = recent[:2], [sum(recent[2 + i * per:2 + (i + 1) * per]) for i in range(len(statuses))]
        workers = [Worker(s["direct_queue"], s.get("node", ""), len(s.get("held", ())) + length)
                   for s, length in zip(statuses, lengths, strict=True)]
        routed_all = [None if raw is None else raw.decode() for raw in routed_raw[:len(keys)]]
        session_of = {key: None if raw is None else raw.decode() for key, raw in zip(sessions, routed_raw[len(keys):],
                                                                                    strict=True)}
        for counts in recent:
            for worker in workers:
                worker.groups += int(counts.get(worker.queue.encode(), 0))
        queues, notes, started, at = [], {}, Counter(), 0
        for placement, names in zip(placements, named, strict=True):
            routed = routed_all[at:at + len(names)]
            at += len(names)
            # Messages placed earlier in this call count: a group's samples follow its first.
            routed = [notes.get(_ROUTE_KEY + name, r) for name, r in zip(names, routed, strict=True)]
            candidates = [w for w in workers if placement.node is None or w.node == placement.node]
            if not candidates:
                queues.append(placement.fallback_queue)
                continue
            worker, new = choose(names, routed, candidates, session_of.get(placement.session_key))
            worker.load += 1
            if new:
                worker.groups += 1
                started[worker.queue] += 1
            queues.append(worker.queue)
            notes.update({_ROUTE_KEY + names[depth - 1]: worker.queue
                          for depth in noted_depths(len(names)) if routed[depth - 1] != worker.queue})
            if placement.session_key is not None:  # written each turn: a live session keeps its route
                notes[placement.session_key] = session_of[placement.session_key] = worker.queue
        if notes or started:  # a group's later samples, routed as noted, write nothing
            pipe = self.client.pipeline(transaction=False)
            for key, queue in notes.items():
                pipe.set(key, queue, ex=ROUTE_TTL_S)
            for queue, count in started.items():
                pipe.hincrby(f"{_GROUPS_KEY}{window}", queue, count)
            pipe.expire(f"{_GROUPS_KEY}{window}", 3 * GROUP_WINDOW_S)
            pipe.execute()
        return queues


# Connection pool -> (read at, statuses): a process's clients of one Redis share what they read.
_live_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _live_statuses(client: redis.Redis) -> list[dict]:
    """The heartbeats of the live GPU workers that take direct messages, read at most every
    :data:`LIVE_REFRESH_S` per connection pool (a heartbeat is written every 2 s anyway)."""
    key, now = client.connection_pool, time.monotonic()
    cached = _live_cache.get(key)
    if cached is not None and now - cached[0] < LIVE_REFRESH_S:
        return cached[1]
    statuses = [s for s in live(client, ("gpu",)).values() if s.get("direct_queue") and s.get("model_ready")]
    _live_cache[key] = (now, statuses)
    return statuses


def register_direct_queue(client: redis.Redis, worker: str) -> None:
    """A GPU worker's queue, noted for the drain and the reaper (before its heartbeat names it)."""
    client.hset(DIRECT_QUEUES_KEY, direct_queue(worker), json.dumps({"worker": worker, "at": time.time()}))


def direct_queues(client: redis.Redis) -> dict[str, dict]:
    """Every registered direct queue (live workers' and those not drained yet) -> its worker and
    when it registered."""
    return {q.decode(): json.loads(entry) for q, entry in client.hgetall(DIRECT_QUEUES_KEY).items()}


class DirectQueueDrain:
    """Sends again what waits in the queue of a GPU worker that is gone (``resend(job_ids, step)``:
    the jobs' generate messages, to their node's or the shared queue, at the priority step of the
    list they waited in), so nothing waits for a worker that will not come back. Each of the
    queue's lists is renamed first (atomic), so a worker that only seemed dead and resumes finds it
    empty rather than racing the move. ``job_id``: how a job id looks in a message."""

    def __init__(self, client: redis.Redis, resend: Callable[[list[str], int], None], job_id: re.Pattern[bytes]):
        self.client = client
        self.resend = resend
        self.job_id = job_id

    def sweep(self) -> list[str]:
        registered = direct_queues(self.client)
        if not registered:
            return []
        alive = {s.get("direct_queue") for s in live(self.client, ("gpu",)).values()}
        # A dead worker's held messages come back to its queue when the held-message sweep gives
        # them back: its queue stays on the list while its heartbeat is still indexed.
        remembered = indexed(self.client, "gpu")
        settled = time.time() - REGISTERED_GRACE_S
        moved = []
        for queue, entry in registered.items():
            beat = entry["worker"] in remembered
            if queue not in alive and (beat or entry["at"] < settled):
                moved += self._drain(queue, forget=not beat)
        return moved

    def _drain(self, queue: str, *, forget: bool) -> list[str]:
        moved = []
        if sum(waiting(self.client, [queue])):
            for step, name in zip(PRIORITY_STEPS, queue_lists(queue), strict=True):
                draining = f"{name}:draining"
                try:
                    self.client.rename(name, draining)
                except redis.ResponseError:  # no such key: nothing waits there
                    continue
                job_ids = sorted({m.decode() for raw in self.client.lrange(draining, 0, -1)
                                  for m in self.job_id.findall(raw)})
                self.resend(job_ids, step)
                self.client.delete(draining)
                moved += job_ids
        if forget:
            self.client.hdel(DIRECT_QUEUES_KEY, queue)
        if moved:
            log.warning("sent %d generate messages left in %s (its worker is gone) again", len(moved), queue)
        return moved
