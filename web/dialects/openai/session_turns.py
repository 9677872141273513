"""An agent's chat turns as one token sequence (#57 item 4): with ``X-Session-ID`` (or the body's
``session_id``), a chat turn whose messages are the last turn's messages, the assistant message
it returned and new messages gets as its prompt the last turn's prompt and sampled ids exactly,
then the bridge the template puts before the new messages (domain/sessions/bridge.py): only the
new messages are tokenized, and the model's own ids are never rendered again from their text.
A turn that cannot continue (the first, other tools or template variables, messages that do not
extend the last turn, media, a template the bridge cannot read) is rendered from its messages,
and its reply names why (``session.reason``, the ``X-Session-Prompt`` header).

Every turn of one choice (``n`` 1) is recorded once it ended: the session's last turn and its
trajectory (domain/sessions/store.py), read by ``GET /v1/sessions/{id}/trajectory``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import flask

from domain.infra.store_errors import STORE_FAILURES
from domain.jobs.results import JobResult
from domain.sessions import fingerprint
from domain.sessions.bridge import BridgeError, bridge
from domain.sessions.store import LastTurn, SessionStore
from web.api.session_header import session_id_of
from web.auth import current_owner
from web.dialects import chat_template
from web.dialects.common import tokenizer
from web.dialects.openai.chat import (
    ChatPrompt,
    chat_job_request,
    chat_messages,
    chat_request,
    checked_template_kwargs,
)
from web.dialects.openai.request import check_model
from web.dialects.openai.tools import checked_tools
from web.services import services

HEADER = "X-Session-Prompt"


def session_store() -> SessionStore:
    svc = services()
    return SessionStore(svc.redis, ttl=svc.settings.result_ttl)


@dataclass
class SessionTurn:
    """One turn of a session: what it was made of and, once it ended, what is recorded of it. Made
    in the request; recorded where its job's end is read (a stream's end runs outside the request)."""

    session_id: str
    owner: str
    last: LastTurn | None
    context: str
    messages: list[str]
    media: bool
    prompt: str = "rendered"  # continued | rendered | tokens
    reason: str | None = None
    end_of_turn: str | None = None
    recorded: bool | None = None
    not_recorded: str | None = None
    _store: SessionStore = field(default_factory=session_store, repr=False)
    _memory: Any = field(default_factory=lambda: services().redis_memory, repr=False)

    def header(self) -> str:
        return self.prompt if self.reason is None else f"{self.prompt}; reason={self.reason}"

    def reply_field(self) -> dict[str, Any]:
        out = {"id": self.session_id, "prompt": self.prompt, "reason": self.reason, "end_of_turn": self.end_of_turn,
               "recorded": bool(self.recorded)}
        if self.not_recorded:
            out["not_recorded"] = self.not_recorded
        return out

    def record(self, job: dict[str, Any], request: dict[str, Any], message: dict[str, Any]) -> None:
        """Record the ended turn (its first choice, and ``message`` as the reply returned it)."""
        result = JobResult.of(job, n=0)
        choice = result.choice(0)
        if choice is None or job.get("status") != "succeeded":
            self.recorded, self.not_recorded = False, "not_completed"
            return
        if self._memory.read().above_high_water:  # counted as new work: nothing written past the mark
            self.recorded, self.not_recorded = False, "redis_memory_full"
            return
        spans = choice.weight_versions or [{"version": result.weight_version, "start": 0, "end": len(choice.token_ids)}]
        try:
            self._store.record(self.owner, self.session_id, self.last, context=self.context, messages=self.messages,
                               returned=fingerprint.returned_digests(message),
                               prompt=list(result.prompt_token_ids or request["token_ids"]),
                               sampled=list(choice.token_ids),
                               stop_token=choice.matched_stop if isinstance(choice.matched_stop, int) else None,
                               media=self.media, logprobs=choice.logprobs, weight_versions=spans, how=self.prompt,
                               reason=self.reason)
        except STORE_FAILURES:
            self.recorded, self.not_recorded = False, "store_unavailable"
            return
        self.recorded = True


def _session(body: dict[str, Any]) -> str | None:
    if body.get("n", 1) != 1:
        return None  # a trajectory is one choice's
    return session_id_of(body, flask.request.headers)


def chat_turn(body: dict[str, Any]) -> tuple[dict[str, Any], SessionTurn | None]:
    """The job request of a chat body and its session turn (None without a session)."""
    session_id = _session(body)
    if session_id is None:
        return chat_request(body), None
    check_model(body.get("model"))
    tools = checked_tools(body)
    kwargs = checked_template_kwargs(body)
    template_messages, parts = chat_messages(body["messages"])
    owner = current_owner()
    turn = SessionTurn(session_id, owner, None, fingerprint.context_digest(tools, kwargs),
                       fingerprint.message_digests(body["messages"]), bool(parts))
    turn.last = turn._store.last_turn(owner, session_id)
    tok = tokenizer()
    special = body.get("add_special_tokens", False)
    generation_prompt = body.get("add_generation_prompt", True)

    def render(messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = chat_template.render(tok, messages, add_generation_prompt=add_generation_prompt, kwargs=kwargs,
                                    tools=tools)
        return tok(text, add_special_tokens=special)["input_ids"]

    ids = _continued(turn, body, template_messages, render, generation_prompt, tok.eos_token_id)
    prompt = ChatPrompt(body, "", parts)
    if ids is None:
        ids = render(template_messages, generation_prompt)
    request = chat_job_request(prompt, ids)
    request["sampling_params"]["logprobs"] = True  # the trajectory's; the reply shows them only if asked
    return request, turn


def _continued(turn: SessionTurn, body: dict[str, Any], template_messages: list[dict], render,
               generation_prompt: bool, eos_id: int | None) -> list[int] | None:
    """The continued prompt's ids, or None with ``turn.reason`` saying why it is rendered."""
    last = turn.last
    if last is None:
        turn.reason = "first_turn"
    elif last.context != turn.context:
        turn.reason = "context_changed"
    elif last.media or turn.media:
        turn.reason = "media"
    elif fingerprint.new_messages(last.messages, last.returned, body["messages"]) is None:
        turn.reason = "messages_do_not_extend"
    else:
        try:
            found = bridge(render, template_messages[len(last.messages) + 1:], add_generation_prompt=generation_prompt,
                           stop_token=last.stop_token, end_of_turn_ids=frozenset({eos_id} - {None}))
        except BridgeError as refused:
            turn.reason = refused.reason
        except chat_template.ChatTemplateRefusedError:
            turn.reason = "template_refused"
        else:
            ids = last.sequence + found.token_ids
            if services().model_facts.placeholder_token_ids.isdisjoint(ids):
                turn.prompt, turn.end_of_turn = "continued", found.end_of_turn
                return ids
            # A sampled media placeholder has no media to stand for: its text is rendered instead.
            turn.reason = "placeholder_sampled"
    return None


def tokens_turn(body: dict[str, Any], context: str) -> SessionTurn | None:
    """The session turn of a ``/v1/chat/completions/tokens`` body (its prompt the client's ids)."""
    session_id = _session(body)
    if session_id is None:
        return None
    owner = current_owner()
    turn = SessionTurn(session_id, owner, None, context, fingerprint.message_digests(body["messages"]), False,
                       prompt="tokens")
    turn.last = turn._store.last_turn(owner, session_id)
    return turn
