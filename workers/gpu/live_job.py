"""What a GPU session knows of each job it runs (``workers/gpu/session.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from domain.jobs.attempts import Fence
from domain.jobs.stored_job import StoredJob
from domain.jobs.stream_text import StreamText


@dataclass
class ChoiceStream:
    sent: int = 0  # tokens staged for publishing so far
    text: StreamText | None = None  # None: the row does not detokenize


@dataclass
class LiveJob:
    job: StoredJob
    prompt: Any
    message_ids: list[str]
    sampling: Any
    attempt: int = 1
    watched: bool = False  # someone reads the job's events: its tokens are published
    streams: dict[int, ChoiceStream] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    stopped_by: str | None = None  # "abort" | "retract": stopped for a weight update
    superseded: bool = False  # a newer attempt runs elsewhere: this one writes nothing more

    @property
    def fence(self) -> Fence:
        return Fence.generation(self.job.id, self.attempt)
