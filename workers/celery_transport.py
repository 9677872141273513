"""Take many waiting messages per wake-up, in one round trip, recorded as they are popped.

kombu's Redis transport takes one message per BRPOP, then records it as unacknowledged with a
MULTI/EXEC of its own (``QoS.append``): two round trips per message, on the consumer's event loop.
A GPU worker's prefetch window is two batches: refilling it after a burst (a batch chunk, a GRPO
step, a restart) paid two round trips per message, and kombu's take was the largest service cost
left in its profile (``bench/README.md``). kombu has no bulk take for Redis (its SQS
transport has one), so this transport adds it: when a BRPOP brings a message and the prefetch
window has room for more, one Lua script records that message and pops up to the room's worth
more from the channel's queues, in the order kombu's BRPOP takes them (every queue's lowest
priority step first: generate messages are ordered between keys by their steps,
``domain/infra/intake_order.py``), recording each in ``unacked`` / ``unacked_index`` exactly as
``QoS.append`` does, before it returns. It also notes the highest intake number taken per key
(``rq:intake:taken``), from which senders tell a key's depth. Popping and recording in one
script leaves no moment where a message is held by nobody (kombu's BRPOP path has one, which
``domain/infra/lost_messages.py`` covers for the first message as before).

The messages are then delivered one by one through kombu's own callback; their QoS entry skips the
Redis write the script already made. Everything else (acks, rejects, restores, the visibility
timeout, ``workers/held_messages.py``) reads the records as kombu wrote them.
``tests/workers/test_celery_transport.py`` pins the kombu internals this relies on. (A connection
that fails over to another of a Sentinel broker's URLs gets that URL's stock transport from kombu,
and takes one message per wake-up from then on, as before.)

The same channels also keep one Redis client for their synchronous calls (publish, ack, restore)
where kombu builds a new one per call (``_BulkTake._create_client``).

Redis at its ``maxmemory`` (noeviction) refuses every command queued in a MULTI, even the ZREM and
HDEL of an ack, which it runs outside one. kombu's QoS writes its acks, records and restores in
MULTIs, and a refused one leaves the message in the consumer's prefetch window for good: a worker
whose acks were refused once (issue #56: 256 at once, its whole window) stopped taking messages,
heartbeat up, also after Redis had room again. So :class:`BulkQoS` acknowledges outside a MULTI,
and what Redis still refuses for memory (recording a message BRPOP popped, giving one back) is
kept or forgotten in the window so that the message is never lost and the window never fills:
see each method.
"""

from __future__ import annotations

import logging
import threading
import time
from queue import Empty

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from domain.infra.intake_order import COUNTS_TTL_S, MARK_HEADER, SENT_KEY, TAKEN_KEY

log = logging.getLogger(__name__)

# How often an unrecorded message given back is pushed again while Redis refuses it.
RESTORE_RETRY_SECONDS = 1.0
# The most one take pops when the window is unbounded (prefetch_count 0).
UNBOUNDED_TAKE = 64

# KEYS: unacked, unacked_index, the intake's sent and taken counts, then the queues' lists in the
# order BRPOP takes them.
# ARGV: now, how many more to pop, the message BRPOP brought, the counts' TTL, the intake mark's header.
# Records the BRPOP'd message, pops up to ARGV[2] more and records each; returns the popped ones,
# each after the index of the list it came from (1 = KEYS[5]). The highest intake number taken per
# key is kept (numbers beyond the key's sent count are from before the counts lapsed: ignored).
# A message that is not kombu's JSON is returned unrecorded (the consumer drops it, as kombu
# would), so the script never stops halfway with messages popped and not recorded.
_TAKE = """
local marks = {}
local function record(item)
  local ok, message = pcall(cjson.decode, item)
  if not ok or type(message) ~= 'table' or type(message['properties']) ~= 'table' then return end
  local properties = message['properties']
  local tag = properties['delivery_tag']
  local delivery = properties['delivery_info']
  if type(tag) ~= 'string' or type(delivery) ~= 'table' then return end
  redis.call('HSET', KEYS[1], tag, '[' .. item .. ',' .. cjson.encode(delivery['exchange']) .. ',' ..
             cjson.encode(delivery['routing_key']) .. ']')
  redis.call('ZADD', KEYS[2], ARGV[1], tag)
  local headers = message['headers']
  local mark = type(headers) == 'table' and headers[ARGV[5]]
  if type(mark) == 'table' and type(mark[1]) == 'string' and type(mark[2]) == 'number' then
    local numbers = marks[mark[1]] or {}
    numbers[#numbers + 1] = mark[2]
    marks[mark[1]] = numbers
  end
end
record(ARGV[3])
local taken = {}
local wanted = tonumber(ARGV[2])
for i = 5, #KEYS do
  if wanted <= 0 then break end
  local items = redis.call('RPOP', KEYS[i], wanted)
  if items then
    for _, item in ipairs(items) do
      record(item)
      taken[#taken + 1] = i - 4
      taken[#taken + 1] = item
    end
    wanted = wanted - #items
  end
end
if next(marks) ~= nil then
  for owner, numbers in pairs(marks) do
    local sent = tonumber(redis.call('HGET', KEYS[3], owner) or '0')
    local best = tonumber(redis.call('HGET', KEYS[4], owner) or '0')
    local highest = best
    for _, number in ipairs(numbers) do
      if number <= sent and number > highest then highest = number end
    end
    if highest > best then redis.call('HSET', KEYS[4], owner, string.format('%d', highest)) end
  end
  redis.call('EXPIRE', KEYS[3], ARGV[4])
  redis.call('EXPIRE', KEYS[4], ARGV[4])
end
return taken
"""


class BulkQoS(kombu_redis.QoS):
    """kombu's Redis QoS that does not write again a record the take script already made, and
    that survives Redis refusing writes for memory (module docs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded: set[str] = set()
        # Messages delivered without a record in ``unacked`` (Redis refused it): their payload is
        # only here, so one given back is pushed to its queue by this process, again until it lands.
        self.unrecorded: dict[str, tuple] = {}
        self._restoring: dict[str, tuple] = {}
        self._restore_lock = threading.Lock()
        self._retry: threading.Timer | None = None

    def append(self, message, delivery_tag):
        if delivery_tag in self.recorded:
            self.recorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
            return
        try:
            super().append(message, delivery_tag)
        except redis.exceptions.OutOfMemoryError:
            # BRPOP popped it and Redis refuses to record it: delivered unrecorded rather than
            # dropped (kombu's own raise loses it). Its job is then found by the job reaper should
            # this worker die holding it (domain/jobs/reaper.py), as in kombu's BRPOP window.
            log.warning("Redis is at its maxmemory: message %s runs unrecorded", delivery_tag)
            delivery = message.delivery_info
            self.unrecorded[delivery_tag] = (message._raw, delivery["exchange"], delivery["routing_key"])
            virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag):
        self.unrecorded.pop(delivery_tag, None)
        super().ack(delivery_tag)

    def _remove_from_indices(self, delivery_tag, pipe=None):
        # Outside a MULTI: Redis runs ZREM and HDEL at its bound, which only free memory.
        return super()._remove_from_indices(delivery_tag, pipe or removal_pipeline(self))

    def reject(self, delivery_tag, requeue=False):
        unrecorded = self.unrecorded.pop(delivery_tag, None)
        if unrecorded is not None:
            if requeue:
                with self._restore_lock:
                    self._restoring[delivery_tag] = unrecorded
                self._restore_unrecorded()
            virtual.QoS.ack(self, delivery_tag)
            return
        try:
            super().reject(delivery_tag, requeue=requeue)
        except redis.exceptions.OutOfMemoryError:
            # Redis refuses to put it back in its queue: it stays in ``unacked``, out of this
            # window; no live worker lists it, so the held-message sweep restores it once Redis
            # has room (workers/held_messages.py).
            log.warning("Redis is at its maxmemory: message %s is left for the held-message sweep", delivery_tag)
            virtual.QoS.ack(self, delivery_tag)


    def restore_visible(self, *args, **kwargs):
        try:
            return super().restore_visible(*args, **kwargs)
        except redis.exceptions.OutOfMemoryError:
            return None  # its lock is a write Redis refuses at its bound: the next round tries again

    def _restore_unrecorded(self) -> None:
        """Push the unrecorded messages given back to the head of their queues; what Redis still
        refuses is tried again every ``RESTORE_RETRY_SECONDS`` from a timer thread. A process that
        dies holding one leaves its job to the job reaper (domain/jobs/reaper.py)."""
        with self._restore_lock:
            for tag, (payload, exchange, routing_key) in list(self._restoring.items()):
                try:
                    with self.channel.conn_or_acquire() as client:
                        pipe = client.pipeline(transaction=False)
                        self.channel._do_restore_message(payload, exchange, routing_key, pipe, leftmost=True)
                        pipe.execute()
                except redis.RedisError as error:
                    if self._retry is None:
                        log.warning("message %s not given back yet (%s); trying again", tag, error.__class__.__name__)
                        self._retry = threading.Timer(RESTORE_RETRY_SECONDS, self._retry_restore)
                        self._retry.daemon = True
                        self._retry.start()
                    return
                del self._restoring[tag]


    def _retry_restore(self) -> None:
        with self._restore_lock:
            self._retry = None
        self._restore_unrecorded()


def removal_pipeline(qos: kombu_redis.QoS):
    """A pipeline for a message's removal from ``unacked``: not a MULTI, which Redis refuses whole at
    its bound (module docs). Its two commands still go in one round trip."""
    with qos.channel.conn_or_acquire() as client:
        return client.pipeline(transaction=False)


class _BulkTake:
    """Mixed into kombu's Redis channels (plain and Sentinel)."""

    QoS = BulkQoS
    _take_script = None
    _sync_client = None

    def _create_client(self, asynchronous=False):
        # kombu builds a new redis.Redis for every synchronous call (each publish, ack, restore):
        # ~200 µs apiece, mostly the client's table of response callbacks, a quarter of a
        # send_task (bench/message_publish.py). A client is a thin front for its pool and safe to
        # share, so one serves the channel until kombu replaces the pool (after a fork).
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        if self._sync_client is None or self._sync_client.connection_pool is not pool:
            self._sync_client = super()._create_client()
        return self._sync_client

    def _brpop_read(self, **options):
        # kombu's own _brpop_read up to the delivery, which is ours.
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # as kombu does: the next poll reconnects
                raise
            if not dest__item:
                raise Empty()
            key, first = dest__item
            queue = bytes_to_str(key).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()
        taken = self._take_more(queue, first)
        if taken is None:
            self._deliver_all([(queue, loads(bytes_to_str(first)))])
            return True
        payloads = []
        for source, item in [(queue, first), *taken]:
            try:
                payloads.append((source, loads(bytes_to_str(item))))
            except ValueError:
                log.error("dropped a message of %s that is not JSON: %.200r", source, item)
        self.qos.recorded.update(tag for tag in (_recorded_tag(p) for _, p in payloads) if tag is not None)
        self._deliver_all(payloads)
        return True

    def _take_more(self, queue: str, first: bytes) -> list[tuple[str, bytes]] | None:
        """Record ``first`` and pop (and record) as many more as the prefetch window allows, from
        every queue this channel consumes, lowest priority step first as BRPOP takes them: each
        with its queue. None when the take failed: then kombu records ``first`` itself, as always.
        With no room left the script still records ``first`` (and notes its intake number)."""
        room = self.qos.can_consume_max_estimate()
        room = UNBOUNDED_TAKE if room is None else max(room - 1, 0)  # ``first`` takes a place
        if self.global_keyprefix:  # a prefixed client rewrites keys: left to kombu
            return None
        queues = self._queue_cycle.consume(len(self.active_queues)) or [queue]
        lists = [(q, self._q_for_pri(q, pri)) for pri in self.priority_steps for q in queues]
        keys = [self.unacked_key, self.unacked_index_key, SENT_KEY, TAKEN_KEY, *(name for _, name in lists)]
        try:
            with self.conn_or_acquire() as client:
                if self._take_script is None:
                    self._take_script = client.register_script(_TAKE)
                reply = self._take_script(keys=keys, args=[time.time(), room, first, COUNTS_TTL_S, MARK_HEADER],
                                          client=client)
        except redis.RedisError as error:
            log.warning("could not take more messages from %s: %s", queue, error)
            return None
        return [(lists[index - 1][0], item) for index, item in zip(reply[::2], reply[1::2], strict=True)]

    def _deliver_all(self, payloads: list[tuple[str, dict]]) -> None:
        """Hand each message to kombu's callback for its queue. When one raises, the rest go back
        to the head of their queue (recorded and never delivered, nobody would run them before the
        visibility timeout) and the error goes on up, as kombu's own would."""
        for index, (queue, payload) in enumerate(payloads):
            try:
                self.connection._deliver(payload, queue)
            except BaseException:
                for _, rest in reversed(payloads[index + 1:]):  # the oldest ends up nearest the head
                    tag = _recorded_tag(rest)
                    if tag is None or tag not in self.qos.recorded:
                        continue  # never recorded: kombu would have dropped it too
                    self.qos.recorded.discard(tag)
                    try:
                        self.qos.restore_by_tag(tag)
                    except redis.RedisError as error:  # left recorded: back after the visibility timeout
                        log.warning("could not give message %s back: %s", tag, error)
                raise


def _recorded_tag(payload) -> str | None:
    """The delivery tag the take script recorded ``payload`` under; None where it recorded none."""
    properties = payload.get("properties") if isinstance(payload, dict) else None
    if not isinstance(properties, dict) or not isinstance(properties.get("delivery_info"), dict):
        return None
    tag = properties.get("delivery_tag")
    return tag if isinstance(tag, str) else None


class Channel(_BulkTake, kombu_redis.Channel):
    pass


class SentinelChannel(_BulkTake, kombu_redis.SentinelChannel):
    pass


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def transport_for(broker_url: str) -> type[kombu_redis.Transport]:
    """The bulk-taking transport for a broker URL ``domain.redis_target.broker_options`` made."""
    return SentinelTransport if broker_url.startswith("sentinel://") else Transport
