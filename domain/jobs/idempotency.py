"""Idempotency keys of submits: a submit sent again with its key answers what the first one made.

A client that meets a closed connection cannot tell whether its submit reached the service; with an
``Idempotency-Key`` it sends the submit again safely. Each key of an owner (API key) has one record,
``rq:idem:<owner>:<key>``: the fingerprint of the body it came with, the claim of the request that
makes its jobs, then its answer (the job ids, and the places the queue caps refused). The record
is claimed in one script, so of two identical submits at once one makes the jobs and the other
answers them; it keeps its answer for ``ROLLOUT_RESULT_TTL``, as long as the jobs' records at least
(they expire that long after they end).

A claim whose request died before it answered (its API process killed between the claim and the
answer, one submit's round trips) lapses after :data:`CLAIM_TTL` seconds; a submit sent again after
that makes its jobs again, the one case where a key does not keep a submit single (README, API).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

import redis

from engine.errors import Fault, RolloutError

CLAIM_TTL = 30  # seconds: a claim's request makes its jobs in milliseconds

# KEYS: the key's record. ARGV: the body's fingerprint, a claim token, the claim's ttl.
# Returns {'claimed'}, {'reused'} (another body), {'done', answer} or {'pending'}.
_CLAIM = """
local fingerprint = redis.call('HGET', KEYS[1], 'fingerprint')
if not fingerprint then
  redis.call('HSET', KEYS[1], 'fingerprint', ARGV[1], 'claim', ARGV[2])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
  return {'claimed'}
end
if fingerprint ~= ARGV[1] then return {'reused'} end
local answer = redis.call('HGET', KEYS[1], 'answer')
if answer then return {'done', answer} end
return {'pending'}
"""

# KEYS: the key's record. ARGV: the claim token, the answer, its ttl. Returns 1 when the claim held.
_ANSWER = """
if redis.call('HGET', KEYS[1], 'claim') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'answer', ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""

# KEYS: the key's record. ARGV: the claim token. A claim whose request made nothing is dropped, so
# the submit sent again may make its jobs.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'claim') == ARGV[1] and redis.call('HEXISTS', KEYS[1], 'answer') == 0 then
  redis.call('DEL', KEYS[1])
end
return 1
"""


class IdempotencyKeyReusedError(RolloutError):
    """The key came before with another body: it names that submit, not this one."""

    code = "idempotency_key_reused"
    fault = Fault.CONFLICT


class IdempotencyKeyInUseError(RolloutError):
    """The first submit with this key is still making its jobs: send it again shortly."""

    code = "idempotency_key_in_use"
    fault = Fault.CONFLICT
    retryable = True


@dataclass(frozen=True)
class Answer:
    """What a submit made: its job ids in request order (None where the queue caps refused one) and
    the refusals as its answer listed them (``{index, code, message}``), with their Retry-After."""

    job_ids: tuple[str | None, ...]
    refused: tuple[dict[str, Any], ...] = ()
    retry_after: str | None = None

    def encode(self) -> str:
        return json.dumps({"job_ids": self.job_ids, "refused": self.refused, "retry_after": self.retry_after})

    @classmethod
    def decode(cls, raw: bytes | str) -> Answer:
        data = json.loads(raw)
        return cls(tuple(data["job_ids"]), tuple(data["refused"]), data["retry_after"])


@dataclass(frozen=True)
class Claim:
    """The right to make a key's jobs: :meth:`IdempotencyStore.answer` or ``release`` it."""

    record: str
    token: str


def fingerprint(route: str, body: Any) -> str:
    """The body as validated (field order and spacing aside) and the route it came to."""
    canonical = json.dumps([route, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


class IdempotencyStore:
    def __init__(self, client: redis.Redis, *, ttl: int):
        self.redis = client
        self.ttl = ttl
        self._claim = client.register_script(_CLAIM)
        self._answer = client.register_script(_ANSWER)
        self._release = client.register_script(_RELEASE)

    @staticmethod
    def key(owner: str, idempotency_key: str) -> str:
        return f"rq:idem:{owner}:{idempotency_key}"

    def claim(self, owner: str, idempotency_key: str, body_fingerprint: str) -> Claim | Answer | None:
        """A :class:`Claim` when this request is the key's first; the first one's
        :class:`Answer` once it answered; None while the first one still makes its jobs.
        :class:`IdempotencyKeyReusedError` when the key came with another body."""
        record, token = self.key(owner, idempotency_key), secrets.token_hex(16)
        reply = self._claim(keys=[record], args=[body_fingerprint, token, CLAIM_TTL])
        state = reply[0].decode()
        if state == "claimed":
            return Claim(record, token)
        if state == "reused":
            raise IdempotencyKeyReusedError(
                "this Idempotency-Key came before with another body; use a new key for another submit")
        if state == "done":
            return Answer.decode(reply[1])
        return None

    def answer(self, claim: Claim, answer: Answer) -> bool:
        """Keep ``answer`` for the key for the result TTL; False when the claim had lapsed."""
        return bool(self._answer(keys=[claim.record], args=[claim.token, answer.encode(), self.ttl]))

    def release(self, claim: Claim) -> None:
        """The claim's request made nothing: the key is free for the submit sent again."""
        self._release(keys=[claim.record], args=[claim.token])
