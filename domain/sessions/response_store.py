"""Stored Responses API responses (``POST /v1/responses`` with ``store``), per API key:
``rq:response:<hash>`` (the key's owner and the response id hashed, as sessions' keys are) holds
the response object as returned, the conversation it answered (chat messages, its
``instructions`` apart) and its assistant message as the chat reply parsed it, and the session
its turn was recorded in, whose token trajectory a ``previous_response_id`` continues
(web/dialects/openai/responses.py). Lives ``ROLLOUT_RESULT_TTL``, as the job's result."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson
import redis

_PREFIX = "rq:response:"


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation the response answered, without its instructions
    assistant: dict[str, Any]  # the reply's assistant message, as chat returned it
    session_id: str | None


class ResponseStore:
    def __init__(self, client: redis.Redis, *, ttl: int):
        self.client = client
        self.ttl = ttl

    @staticmethod
    def key(owner: str, response_id: str) -> str:
        return _PREFIX + hashlib.blake2b(f"{owner}\x1f{response_id}".encode(), digest_size=16).hexdigest()

    def put(self, owner: str, stored: StoredResponse) -> None:
        data = orjson.dumps({"response": stored.response, "messages": stored.messages,
                             "assistant": stored.assistant, "session_id": stored.session_id})
        self.client.set(self.key(owner, stored.response["id"]), data, ex=self.ttl)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        raw = self.client.get(self.key(owner, response_id))
        if raw is None:
            return None
        data = orjson.loads(raw)
        return StoredResponse(data["response"], data["messages"], data["assistant"], data["session_id"])
