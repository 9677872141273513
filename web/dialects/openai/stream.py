"""OpenAI's and vLLM's stream chunks: ``/v1/completions``, ``/v1/chat/completions`` and vLLM's
``/inference/v1/generate`` with ``stream: true``.

Completions (``object: text_completion``) and chat (``object: chat.completion.chunk``) chunks as
OpenAI's API reference and vLLM's ``serving_completion.py`` / ``serving_chat.py`` send them: each
chunk a delta (``text``, or ``delta.content`` after a first ``delta.role`` chunk), ``finish_reason``
null until the choice's last chunk; with ``stream_options.include_usage`` every chunk has
``usage: null`` and one last chunk has ``choices: []`` and the usage; then ``data: [DONE]``. vLLM's
extensions ride along: ``token_ids`` per chunk with ``return_token_ids`` and the prompt's ids on the
first (chat: ``prompt_token_ids`` beside each choice's role chunk; completions: in each choice's
first chunk, as vLLM's serving_chat / serving_completion send them), ``stop_reason``.
vLLM's generate: each chunk's ``choices[].token_ids`` are the new token ids only (a delta).

Streamed logprobs are those of the sampled tokens; the top alternatives (``top_logprobs``) are in
the non-streamed reply and the job's result, not in stream chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from domain.error_statuses import http_status
from domain.jobs.follow import ChoiceDelta, TokenLedger
from domain.jobs.results import JobResult
from engine.errors import RolloutError
from engine.routing.encoding import nested
from web.api.streams import sse
from web.dialects import openai
from web.dialects.common import TokenTexts, reply_model_name, usage
from web.dialects.errors import openai_shape
from web.dialects.openai.session_turns import SessionTurn
from web.dialects.openai.tools import reply_parsers
from web.dialects.vllm import request as vllm
from web.parsers.message import MessageStream, finish_reason, parsed_message
from web.services import services


def _error(error: RolloutError) -> bytes:
    return sse(openai_shape(http_status(error), error.code, error.message, error.errors))


def prompt_token_ids(jobs, job: dict, request: dict) -> list[int]:
    """The ids a job's prompt runs as (media placeholders expanded): its result's once it ended,
    else the finalized prompt the GPU worker runs (stored until the job ends), else the request's."""
    stored = job.get("result")
    if not stored:
        (raw,) = jobs.prompts([job["id"]])
        stored = json.loads(raw) if raw else {}
    return stored.get("prompt_token_ids") or stored.get("token_ids") or request.get("token_ids") or []


def _usage(jobs: list[dict]) -> dict:
    return usage(*(JobResult.of(job) for job in jobs))


class _OpenAIChunks:
    object_name = ""
    prefix = ""

    def __init__(self, body: dict[str, Any], requests: list[dict]):
        self.body = body
        self.requests = requests
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.created = int(time.time())
        self.model = reply_model_name()
        self.spell = openai.speller(TokenTexts(), body.get("return_tokens_as_token_ids", False))
        self._base: dict[str, int] = {}
        self.id = ""
        self._jobs = services().jobs  # built in the request; its chunks are made outside its context
        self._prompt_sent: set[tuple[str, int]] = set()

    def _prompt_ids(self, job: dict, index: int) -> dict[str, list[int]]:
        """``{"prompt_token_ids": ...}`` for a choice's first chunk with ``return_token_ids``, else
        ``{}``: the ids the job runs (media expanded), from its result or its stored prompt."""
        if not self.body.get("return_token_ids") or (job["id"], index) in self._prompt_sent:
            return {}
        self._prompt_sent.add((job["id"], index))
        return {"prompt_token_ids": prompt_token_ids(self._jobs, job,
                                                     self.requests[list(self._base).index(job["id"])])}

    def bind(self, jobs: list[dict]) -> None:
        at = 0
        for request, job in zip(self.requests, jobs, strict=True):
            self._base[job["id"]] = at
            at += request["sampling_params"]["n"]
        self.id = self.prefix + jobs[0]["id"].removeprefix("job_")

    def _chunk(self, choices: list[dict], **extra) -> bytes:
        chunk = {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                 "choices": choices, **extra}
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def end(self, jobs: list[dict]) -> list[bytes]:
        if not self.include_usage:
            return []
        return [sse({"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                     "choices": [], "usage": _usage(jobs)})]

    def error(self, error: RolloutError) -> bytes:
        return _error(error)

    def _index(self, job_id: str, choice: int) -> int:
        return self._base[job_id] + choice

    def _finals(self, job: dict, finals: list[ChoiceDelta], ledger: TokenLedger) -> list[bytes]:
        if finals:
            return [self._final(job, delta, ledger) for delta in finals]
        # Cancelled before it ran: no choices; each ends aborted and empty.
        n = self.requests[list(self._base).index(job["id"])]["sampling_params"]["n"]
        return [self._final(job, ChoiceDelta(job["id"], i, finish_reason="abort"), ledger) for i in range(n)]

    def done(self, job: dict, finals: list[ChoiceDelta], ledger: TokenLedger) -> list[bytes]:
        return self._finals(job, finals, ledger)

    def _stop_reason(self, job: dict, index: int):
        choice = JobResult.of(job, n=0).choice(index)
        return openai.stop_reason(choice) if choice else None

    def _ended(self, entry: dict, job: dict, delta: ChoiceDelta) -> dict:
        """A choice's last chunk: its finish and, with return_sampling_mask, its whole mask."""
        entry.update(finish_reason=delta.finish_reason, stop_reason=self._stop_reason(job, delta.index))
        params = self.requests[list(self._base).index(job["id"])]["sampling_params"]
        if params.get("sampling_mask"):
            choice = JobResult.of(job, n=0).choice(delta.index)
            entry["sampling_mask"] = choice.sampling_mask if choice else None
        if params.get("routed_experts"):  # return_routed_experts: the whole choice's, on its end only
            choice = JobResult.of(job, n=0).choice(delta.index)
            entry["routed_experts"] = nested(choice.routed_experts) if choice else None
        return entry


class CompletionChunks(_OpenAIChunks):
    object_name = "text_completion"
    prefix = "cmpl-"

    def _choice(self, job: dict, delta: ChoiceDelta) -> dict:
        entry: dict[str, Any] = {"index": self._index(job["id"], delta.index), "text": delta.text, "logprobs": None,
                                 "finish_reason": None, "stop_reason": None, **self._prompt_ids(job, delta.index)}
        if self.body.get("logprobs") is not None and delta.token_ids:
            choice = replace(delta.as_choice(), logprobs=delta.logprobs or [None] * len(delta.token_ids))
            entry["logprobs"] = openai.completion_logprobs(choice, None, [], {}, self.spell)
        if self.body.get("return_token_ids"):
            entry["token_ids"] = delta.token_ids
        return entry

    def delta(self, job: dict, delta: ChoiceDelta, ledger: TokenLedger) -> list[bytes]:
        return [self._chunk([self._choice(job, delta)])]

    def _final(self, job: dict, delta: ChoiceDelta, ledger: TokenLedger) -> bytes:
        return self._chunk([self._ended(self._choice(job, delta), job, delta)])


class ChatChunks(_OpenAIChunks):
    object_name = "chat.completion.chunk"
    prefix = "chatcmpl-"

    def __init__(self, body: dict[str, Any], requests: list[dict], session: SessionTurn | None = None):
        super().__init__(body, requests)
        self._session = session  # recorded at its job's end (web/dialects/openai/session_turns.py)
        self._started: set[tuple[str, int]] = set()
        self._parsers = reply_parsers(body)  # built in the request; its chunks are made outside its context
        self._messages: dict[tuple[str, int], MessageStream] = {}

    def _message(self, job_id: str, delta: ChoiceDelta, *, final: bool) -> dict:
        """The delta's message part: its text as is, or what the reply parsers settled of it."""
        if self._parsers.reasoning is None and self._parsers.tools is None:
            return {"content": delta.text} if delta.text or not final else {}
        stream = self._messages.setdefault((job_id, delta.index), MessageStream(self._parsers))
        return stream.feed(delta.text or "", final=final)

    def _called(self, job_id: str, index: int) -> bool:
        stream = self._messages.get((job_id, index))
        return stream is not None and stream.called

    def _choices(self, job_id: str, delta: ChoiceDelta, content: dict) -> list[dict]:
        out = []
        if (job_id, delta.index) not in self._started:
            self._started.add((job_id, delta.index))
            out.append({"index": delta.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
        entry: dict[str, Any] = {"index": delta.index, "delta": content, "logprobs": None, "finish_reason": None}
        if self.body.get("logprobs") and delta.token_ids:
            entry["logprobs"] = {"content": openai.chat_logprob_entries(delta.as_choice(), self.spell, 0)}
        if self.body.get("return_token_ids"):
            entry["token_ids"] = delta.token_ids
        out.append(entry)
        return out

    def delta(self, job: dict, delta: ChoiceDelta, ledger: TokenLedger) -> list[bytes]:
        content = self._message(job["id"], delta, final=False)
        entries = self._choices(job["id"], delta, content)
        if not content and set(entries[-1]) == {"index", "delta", "logprobs", "finish_reason"} \
                and entries[-1]["logprobs"] is None:
            entries.pop()  # held back by a parser, and nothing else to carry
        return [self._chunk([entry], **self._role_extra(job, entry)) for entry in entries]

    def _role_extra(self, job: dict, entry: dict) -> dict:
        return self._prompt_ids(job, entry["index"]) if "role" in entry["delta"] else {}

    def done(self, job: dict, finals: list[ChoiceDelta], ledger: TokenLedger) -> list[bytes]:
        chunks = self._finals(job, finals, ledger)
        if self._session is not None:
            choice = JobResult.of(job, n=0).choice(0)
            self._session.record(job, self.requests[0], parsed_message((choice.text if choice else "") or "",
                                                                       self._parsers))
        return chunks

    def _final(self, job: dict, delta: ChoiceDelta, ledger: TokenLedger) -> bytes:
        entries = self._choices(job["id"], delta, self._message(job["id"], delta, final=True))
        self._ended(entries[-1], job, delta)
        entries[-1]["finish_reason"] = finish_reason(delta.finish_reason, self._called(job["id"], delta.index))
        return b"".join(self._chunk([entry], **self._role_extra(job, entry)) for entry in entries)


class GenerateChunks:
    """vLLM's ``/inference/v1/generate``: token-id deltas per chunk; the last one per job carries
    the finish reasons, usage, weight version and each choice's whole ``sampling_mask`` and
    ``weight_versions``; with
    ``return_token_ids`` the first one carries ``prompt_token_ids`` and ``mm_placeholders`` (as vLLM's)."""

    def __init__(self, body: dict[str, Any], request: dict):
        self.body = body
        self.request = request
        self.k = body["sampling_params"].get("logprobs")
        self._prompt_sent = not body.get("return_token_ids")
        self._jobs = services().jobs  # built in the request; its chunks are made outside its context

    def bind(self, jobs: list[dict]) -> None:
        pass

    def _choice(self, delta: ChoiceDelta) -> dict:
        logprobs = None
        if self.k is not None:
            logprobs = {"content": vllm.token_logprobs(delta.as_choice(), self.k)}
        return {"index": delta.index, "token_ids": delta.token_ids, "finish_reason": delta.finish_reason,
                "logprobs": logprobs}

    def _prompt(self, chunk: dict, job: dict) -> dict:
        """The first chunk's prompt fields: from the result once the job ended, else from the
        finalized prompt the GPU worker is running (stored until the job ends)."""
        if self._prompt_sent:
            return chunk
        self._prompt_sent = True
        stored = job.get("result")
        if not stored:
            (raw,) = self._jobs.prompts([job["id"]])
            stored = json.loads(raw) if raw else {"token_ids": self.request.get("token_ids") or []}
        chunk["prompt_token_ids"] = stored.get("prompt_token_ids", stored.get("token_ids"))
        chunk["mm_placeholders"] = vllm.mm_placeholders(stored.get("placeholder_ranges") or [])
        return chunk

    def delta(self, job: dict, delta: ChoiceDelta, ledger: TokenLedger) -> list[bytes]:
        delta.finish_reason = None
        return [sse(self._prompt({"request_id": self.body.get("request_id") or job["id"],
                                  "choices": [self._choice(delta)], "job_id": job["id"]}, job))]

    def done(self, job: dict, finals: list[ChoiceDelta], ledger: TokenLedger) -> list[bytes]:
        result = JobResult.of(job)
        if not finals:
            finals = [ChoiceDelta(job["id"], i, finish_reason="abort")
                      for i in range(self.request["sampling_params"]["n"])]
        choices = []
        for delta in finals:
            entry, ended = self._choice(delta), result.choice(delta.index)
            entry["sampling_mask"] = ended.sampling_mask if ended else None  # the whole choice's, on its end
            entry["weight_versions"] = (ended.weight_versions or []) if ended else []  # as vLLM: on the final chunk
            entry["routed_experts"] = nested(ended.routed_experts) if ended else None  # the whole choice's, at its end
            choices.append(entry)
        return [sse(self._prompt({"request_id": self.body.get("request_id") or job["id"], "choices": choices,
                                  "usage": usage(result), "job_id": job["id"],
                                  "weight_version": result.weight_version}, job))]

    def end(self, jobs: list[dict]) -> list[bytes]:
        return []

    def error(self, error: RolloutError) -> bytes:
        return _error(error)
