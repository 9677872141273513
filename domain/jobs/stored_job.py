"""A stored job, typed: the one read of a job record that a worker runs from.

The job record (domain/jobs/store.py) is a flat hash; its ``request`` is the validated dict the
API stored. Every place that runs a stored job reads it here, so the request is rebuilt with one
constructor (:meth:`JobRequest.from_dict`, which maps API meaning to engine meaning) and a job's
owner, KV scope, adapter and (once a GPU worker began it) generation attempt come from the same
fields everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from domain.jobs.request import JobRequest

if TYPE_CHECKING:
    from domain.jobs.events import Attempt


@dataclass(frozen=True)
class StoredJob:
    id: str
    owner: str
    kind: str  # "generate" | "score"
    status: str
    created_at: float | None
    # The decoded record it was read from: its request as stored, and the fields no worker types.
    record: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Its generation attempt once a GPU worker began it (domain/jobs/attempts.py), else None.
    attempt: Attempt | None = field(default=None, compare=False)

    @classmethod
    def of(cls, record: dict[str, Any]) -> StoredJob:
        """The typed job of a decoded record (``JobStore.get``'s, ``get_many``'s, ``with_prompts``')."""
        return cls(id=record["id"], owner=record["owner"], kind=record["kind"], status=record["status"],
                   created_at=record.get("created_at"), record=record)

    @cached_property
    def request(self) -> JobRequest:
        """The stored request, typed. Built at first use: it raises InvalidRequestError (422) for a
        request the engine refuses (:meth:`JobRequest.from_dict`), inside the caller's ``try`` that
        fails that job alone, not where the job is read."""
        return JobRequest.from_dict(self.record["request"])

    def began(self, attempt: Attempt | None) -> StoredJob:
        """This job under the generation attempt a GPU worker began for it."""
        return replace(self, attempt=attempt)

    @property
    def adapter_id(self) -> str:
        """The engine id of the LoRA adapter it runs under: the one the API resolved (``lora_id``),
        else the name a batch line gave (no engine id: the engine refuses it); "" is the base."""
        request = self.record.get("request") or {}
        return request.get("lora_id") or request.get("adapter") or ""

    @property
    def cache_scope(self) -> str:
        """Whose KV blocks the job may reuse (:meth:`JobRequest.cache_scope`)."""
        return self.request.cache_scope(self.owner)
