"""Following a job's events (``GET /v1/jobs/{id}/events``) from the client.

The SSE reading is written here (30 lines) rather than taken from a library because the client
needs only ``requests``, and the format is a handful of line rules (the HTML spec's "event stream
interpretation": ``data``/``event``/``id`` fields, ``:`` comments, a blank line ends a message).

:class:`JobStream` iterates the events as dicts ``{"event", "id", "data"}``, reconnects with
``Last-Event-ID`` when the connection drops or the server says ``interrupted`` (the job is
durable; the stream is a view of it), and
keeps each choice's tokens and text so far. A ``restart`` event (the job's GPU worker died and the
job runs again from its prompt) clears them, and tokens of an older attempt are dropped, so at the
end ``token_ids`` equal the result's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import requests

from .errors import ClientError, ConnectionFailedError


def sse_messages(response: requests.Response) -> Iterator[dict[str, Any]]:
    event, data, event_id = "message", [], None
    for line in response.iter_lines(decode_unicode=True):
        if line is None:
            continue
        if line == "":
            if data:
                yield {"event": event, "id": event_id, "data": json.loads("\n".join(data))}
            event, data, event_id = "message", [], None
        elif line.startswith(":"):
            continue  # a comment: keep-alive
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name == "event":
                event = value
            elif name == "id":
                event_id = value


class JobStream:
    """A job's events as they happen; ``token_ids``, ``text`` (by choice) and ``result`` as it goes."""

    def __init__(self, client, job_id: str, *, last_event_id: str | None = None, reconnects: int = 5):
        self.client = client
        self.job_id = job_id
        self.last_event_id = last_event_id
        self.reconnects = reconnects
        self.attempt = 0
        self.token_ids: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.status: str | None = None
        self.result: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        failures = 0
        while True:
            headers = {"Last-Event-ID": self.last_event_id} if self.last_event_id else {}
            try:
                response = self.client._request("GET", f"/v1/jobs/{self.job_id}/events", headers=headers,
                                                stream=True, timeout=(self.client.timeout, 60), idempotent=True)
                with response:
                    for message in sse_messages(response):
                        failures = 0
                        if message["id"]:
                            self.last_event_id = message["id"]
                        if message["event"] == "interrupted":  # the server lost Redis for long: resume
                            raise ConnectionFailedError(f"the events of {self.job_id} were interrupted")
                        if self._take(message):
                            yield message
                        if message["event"] in ("result", "error"):
                            if message["event"] == "error":
                                data = message["data"]
                                raise ClientError(data.get("code", "internal_error"), data.get("message", ""))
                            return
            except (requests.ConnectionError, requests.Timeout, ConnectionFailedError) as exc:
                failures += 1
                if failures > self.reconnects:
                    raise ConnectionFailedError(f"the events of {self.job_id} stopped: {exc.__class__.__name__}") \
                        from exc
                time.sleep(min(0.2 * 2 ** failures, 5.0))
                continue
            # The server closed the stream before its end (a restart of the API): resume.
            failures += 1
            if failures > self.reconnects:
                raise ConnectionFailedError(f"the events of {self.job_id} ended before the job did")

    def _take(self, message: dict[str, Any]) -> bool:
        kind, data = message["event"], message["data"]
        if kind == "status":
            self.status = data["status"]
        elif kind == "restart":
            if data["attempt"] < self.attempt:
                return False
            self.attempt = data["attempt"]
            self.token_ids.clear()
            self.text.clear()
        elif kind == "tokens":
            if data["attempt"] < self.attempt:
                return False  # a dead attempt's straggler
            self.attempt = data["attempt"]
            for choice in data["choices"]:
                ids = self.token_ids.setdefault(choice["index"], [])
                del ids[choice["offset"]:]  # never twice, even if an entry is read again
                ids.extend(choice["token_ids"])
                self.text[choice["index"]] = self.text.get(choice["index"], "") + (choice.get("text") or "")
        elif kind == "result":
            self.result = data
            self.status = data.get("status")
            # The result is the whole of each choice: tokens the stream did not carry (the job ended
            # before the server saw this reader) are in it too.
            for choice in (data.get("result") or {}).get("choices") or []:
                self.token_ids[choice["index"]] = list(choice["token_ids"])
                self.text[choice["index"]] = choice.get("text") or ""
        return True
