"""Each session's last turn and trajectory in Redis, per API key: ``rq:session:<hash>`` (the key's
owner and the session id hashed: two keys' sessions never meet, and a session id is never a key's
text) holds the last turn: its context and messages' fingerprints (``fingerprint``), its returned
message's, its prompt and sampled ids packed (4 bytes an id), its stop token, its segment and turn
number; ``rq:session:<hash>:seg:<n>`` lists segment n's turns (``trajectory.TurnEntry``).

Bounded: a segment holds at most one context of tokens (each turn's prompt and sampled ids fit
the context, and a segment's turns only extend it), and only the last :data:`MAX_SEGMENTS`
segments are kept. Every key lives ``ROLLOUT_RESULT_TTL`` from the session's last turn, as long as
the turn's job. The API writes a turn only below Redis' high-water mark, as it admits new work
(web/dialects/openai/session_turns.py)."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import orjson
import redis

from domain.sessions.trajectory import TurnEntry, segment_view

MAX_SEGMENTS = 4
MAX_TURNS_PER_SEGMENT = 4096
_PREFIX = "rq:session:"


def _pack(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def _unpack(data: bytes | None) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data)) if data else []


@dataclass(frozen=True)
class LastTurn:
    context: str
    messages: list[str]  # the digests of its messages, as sent
    returned: list[str]  # the digests its returned assistant message may come back with
    prompt: list[int]
    sampled: list[int]
    stop_token: int | None  # the stop token id that ended it; None: cut short (length, a stop string)
    media: bool  # its prompt held media: the next turn is rendered
    segment: int
    turn: int

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.sampled


class SessionStore:
    def __init__(self, client: redis.Redis, *, ttl: int):
        self.client = client
        self.ttl = ttl

    @staticmethod
    def key(owner: str, session_id: str) -> str:
        return _PREFIX + hashlib.blake2b(f"{owner}\x1f{session_id}".encode(), digest_size=16).hexdigest()

    def last_turn(self, owner: str, session_id: str) -> LastTurn | None:
        raw = self.client.hgetall(self.key(owner, session_id))
        if not raw or b"turn" not in raw:
            return None
        stop = raw.get(b"stop_token", b"")
        return LastTurn(context=raw[b"context"].decode(), messages=json.loads(raw[b"messages"]),
                        returned=json.loads(raw[b"returned"]), prompt=_unpack(raw.get(b"prompt")),
                        sampled=_unpack(raw.get(b"sampled")), stop_token=int(stop) if stop else None,
                        media=raw.get(b"media") == b"1", segment=int(raw[b"segment"]), turn=int(raw[b"turn"]))

    def record(self, owner: str, session_id: str, last: LastTurn | None, *, context: str, messages: list[str],
               returned: list[str], prompt: list[int], sampled: list[int], stop_token: int | None, media: bool,
               logprobs: list[float] | None, weight_versions: list[dict], how: str,
               reason: str | None) -> TurnEntry:
        """Record a turn that ended after ``last`` (the last turn as the turn read it): the session's
        new last turn, and the turn in its segment (the last one's when ``prompt`` starts with the
        last turn's sequence, else a new one)."""
        key = self.key(owner, session_id)
        if last is not None and prompt[:len(last.prompt) + len(last.sampled)] == last.sequence:
            segment, given = last.segment, prompt[len(last.prompt) + len(last.sampled):]
        else:
            segment, given = (last.segment + 1 if last is not None else 0), prompt
        entry = TurnEntry(turn=(last.turn + 1 if last is not None else 1), segment=segment, given=list(given),
                          sampled=list(sampled), logprobs=logprobs, weight_versions=weight_versions, prompt=how,
                          reason=reason)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, mapping={"context": context, "messages": json.dumps(messages), "returned": json.dumps(returned),
                                "prompt": _pack(prompt), "sampled": _pack(sampled),
                                "stop_token": "" if stop_token is None else str(stop_token), "media": "1" if media else "0",
                                "segment": segment, "turn": entry.turn})
        pipe.expire(key, self.ttl)
        seg_key = f"{key}:seg:{segment}"
        pipe.rpush(seg_key, orjson.dumps(entry.to_record()))
        pipe.ltrim(seg_key, -MAX_TURNS_PER_SEGMENT, -1)
        for kept in range(max(0, segment - MAX_SEGMENTS + 1), segment + 1):
            pipe.expire(f"{key}:seg:{kept}", self.ttl)
        if segment >= MAX_SEGMENTS:
            pipe.delete(f"{key}:seg:{segment - MAX_SEGMENTS}")
        pipe.execute()
        return entry

    def fork(self, owner: str, source: str, target: str) -> bool:
        """``target`` made a copy of ``source`` as it is now (last turn and kept segments), for a
        Responses API turn continuing a stored response (web/dialects/openai/responses.py): each
        response records in its own session, so calls continuing one response branch apart
        instead of interleaving in one trajectory. False: ``source`` is gone (expired)."""
        key, copy = self.key(owner, source), self.key(owner, target)
        segment = self.client.hget(key, "segment")
        if segment is None:
            return False
        pipe = self.client.pipeline(transaction=True)
        pipe.copy(key, copy, replace=True)
        pipe.expire(copy, self.ttl)
        for n in range(max(0, int(segment) - MAX_SEGMENTS + 1), int(segment) + 1):
            pipe.copy(f"{key}:seg:{n}", f"{copy}:seg:{n}", replace=True)
            pipe.expire(f"{copy}:seg:{n}", self.ttl)
        pipe.execute()
        return True

    def trajectory(self, owner: str, session_id: str) -> dict | None:
        """The session's kept segments, oldest first (None: no such session of this owner)."""
        key = self.key(owner, session_id)
        raw = self.client.hmget(key, "segment", "turn")
        if raw[0] is None:
            return None
        last = int(raw[0])
        numbers = list(range(max(0, last - MAX_SEGMENTS + 1), last + 1))
        pipe = self.client.pipeline(transaction=False)
        for n in numbers:
            pipe.lrange(f"{key}:seg:{n}", 0, -1)
        segments = []
        for items in pipe.execute():
            entries = [TurnEntry.from_record(orjson.loads(item)) for item in items]
            if entries:
                segments.append(segment_view(entries))
        return {"turns": int(raw[1]), "segments": segments}
