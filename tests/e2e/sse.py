"""A small Server-Sent Events reader for tests (over a ``requests`` streamed response)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Message:
    event: str
    data: str
    id: str | None

    def json(self):
        return json.loads(self.data)


def messages(response, *, comments: list | None = None):
    """SSE messages as they arrive; comment lines (keep-alives) go to ``comments`` when given."""
    event, data, event_id = "message", [], None
    for raw in response.iter_lines(decode_unicode=True):
        if raw is None:
            continue
        if raw == "":
            if data:
                yield Message(event, "\n".join(data), event_id)
            event, data, event_id = "message", [], None
            continue
        if raw.startswith(":"):
            if comments is not None:
                comments.append(raw)
            continue
        name, _, value = raw.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id":
            event_id = value
