"""``POST /v1/responses`` with ``stream: true``: the Responses API's events as OpenAI sends them
(names and fields as the official client's types in openai/types/responses/ have them):
``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``,
its deltas (``response.reasoning_text.delta``, ``response.content_part.added`` /
``response.output_text.delta``, ``response.function_call_arguments.delta``), its ``.done`` events
and ``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it). Each event's ``sequence_number`` counts from 0.

The text is read by the chat stream's parsers (web/parsers/message.py's ``MessageStream``): a
reasoning delta opens a reasoning item, content a message item, a new call a function_call item;
the completed response holds the items as streamed."""

from __future__ import annotations

import secrets
from typing import Any

from domain.jobs.follow import ChoiceDelta, TokenLedger
from domain.jobs.results import JobResult
from engine.errors import RolloutError
from web.api.streams import sse
from web.auth import current_owner
from web.dialects.openai import responses as api
from web.dialects.openai.session_turns import SessionTurn
from web.dialects.openai.stream import _error
from web.dialects.openai.tools import reply_parsers
from web.parsers.message import MessageStream, parsed_message
from web.services import services


class ResponseEvents:
    def __init__(self, body: dict[str, Any], chat: dict[str, Any], request: dict[str, Any], turn: SessionTurn | None):
        self.body, self.chat, self.request, self.turn = body, chat, request, turn
        self.parsers = reply_parsers(chat)
        self.stream = MessageStream(self.parsers)
        self.created = api.now()
        self.id = ""
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, int] = {}  # the parser's call index -> its output index
        self._seq = 0
        self._started = False
        # Built in the request; the events are made outside its context.
        self._store, self._owner, self._memory = api.response_store(), current_owner(), services().redis_memory
        self._in_progress = api.response_object(body, chat, "", self.created)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(data, event=kind)

    def bind(self, jobs: list[dict[str, Any]]) -> None:
        self.id = "resp_" + jobs[0]["id"].removeprefix("job_")
        self._in_progress["id"] = self.id

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        return [self._event("response.created", response=self._in_progress),
                self._event("response.in_progress", response=self._in_progress)]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=_in_progress(item)))
        if item["type"] != "function_call":
            out.append(self._event("response.content_part.added", output_index=index, item_id=item["id"],
                                   content_index=0, part={**item["content"][0], "text": ""}))
        return out

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, out = self.items.index(item), []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", output_index=index, item_id=item["id"],
                                   name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            out.append(self._event(kind, output_index=index, item_id=item["id"], content_index=0, text=part["text"],
                                   **extra))
            out.append(self._event("response.content_part.done", output_index=index, item_id=item["id"],
                                   content_index=0, part=part))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._open is None or self._open["type"] != kind:
            out += self._add(api.reasoning_item("rs_" + secrets.token_hex(12), "") if kind == "reasoning"
                             else api.message_item("msg_" + secrets.token_hex(12), ""))
        item = self._open
        item["content"][0]["text"] += text
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self._event(event, output_index=len(self.items) - 1, item_id=item["id"], content_index=0,
                               delta=text, **extra))
        return out

    def _feed(self, text: str, *, final: bool) -> list[bytes]:
        delta = self.stream.feed(text, final=final)
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a new call: its item, then its arguments so far
                out += self._add(api.call_item("fc_" + secrets.token_hex(12), call["id"], call["function"]["name"], ""))
                self._calls[call["index"]] = len(self.items) - 1
            index = self._calls[call["index"]]
            item, fragment = self.items[index], call["function"].get("arguments") or ""
            if fragment:
                item["arguments"] += fragment
                out.append(self._event("response.function_call_arguments.delta", output_index=index,
                                       item_id=item["id"], delta=fragment))
        return out

    def delta(self, job: dict, delta: ChoiceDelta, ledger: TokenLedger) -> list[bytes]:
        return self._start() + self._feed(delta.text or "", final=False)

    def done(self, job: dict, finals: list[ChoiceDelta], ledger: TokenLedger) -> list[bytes]:
        final = finals[0] if finals else ChoiceDelta(job["id"], 0, finish_reason="abort")
        out = self._start() + self._feed(final.text or "", final=True)
        if not self.items:  # nothing was written: one empty message, as the plain reply has
            out += self._add(api.message_item("msg_" + secrets.token_hex(12), ""))
        out += self._close()
        response = api.response_object(self.body, self.chat, self.id, self.created, output=self.items, job=job,
                                       finish=final.finish_reason, turn=self.turn, model=self._in_progress["model"])
        choice = JobResult.of(job, n=0).choice(0)
        assistant = parsed_message((choice.text if choice else "") or "", self.parsers)
        for call, item in zip(assistant["tool_calls"], [i for i in self.items if i["type"] == "function_call"],
                              strict=False):
            call["id"] = item["call_id"]  # the ids the client saw answer the next turn's outputs
        if self.turn is not None:
            self.turn.record(job, self.request, assistant)
            response["session"] = self.turn.reply_field()
        api.keep(self.body, self.chat, response, assistant, self.turn, self._store, self._owner, self._memory)
        kind = {"incomplete": "response.incomplete", "cancelled": "response.failed"}.get(response["status"],
                                                                                        "response.completed")
        return [*out, self._event(kind, response=response)]

    def end(self, jobs: list[dict[str, Any]]) -> list[bytes]:
        return []

    def error(self, error: RolloutError) -> bytes:
        return _error(error)


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    """An item as ``output_item.added`` shows it: in progress, its text or arguments still empty."""
    if item["type"] == "function_call":
        return {**item, "status": "in_progress", "arguments": ""}
    return {**item, "status": "in_progress", "content": []}
