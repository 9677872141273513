"""SGLang's ``stream: true`` on ``/generate``: ``data: {text, output_ids, meta_info}`` chunks, then
``data: [DONE]``.

As sglang sends them (``python/sglang/srt/managers/tokenizer_manager.py``, ``_handle_batch_output``:
``state.text += ...`` and ``output_ids`` the whole list unless the server runs with
``--stream-output``; ``python/sglang/srt/entrypoints/http_server.py`` writes each as
``data: <json>\\n\\n`` and ends with ``data: [DONE]``): every chunk is cumulative, the text and
output ids so far, so a client keeps only the last one. A batch or ``n`` > 1 adds ``index`` (the
reply's position in the non-streamed list). A choice's last chunk is exactly its non-streamed
reply (full ``meta_info``); earlier chunks carry ``id``, ``finish_reason: null``,
``completion_tokens``, ``job_id`` and, with ``return_logprob``, ``output_token_logprobs`` so far.
An error mid-stream is ``data: {"error": {"message", "code"}}`` as sglang's is.
"""

from __future__ import annotations

from typing import Any

from domain.error_statuses import http_status
from domain.jobs.follow import ChoiceDelta, TokenLedger
from engine.errors import RolloutError
from web.api.streams import sse
from web.dialects.common import TokenTexts
from web.dialects.errors import sglang_shape
from web.dialects.sglang import request as sglang


class SglangChunks:
    def __init__(self, requests: list[dict], options: list[dict], batch: bool, return_text: bool):
        self.requests = requests
        self.options = options
        self.texts = TokenTexts() if return_text else None
        self.numbered = batch or any(r["sampling_params"]["n"] > 1 for r in requests)
        self._position: dict[str, int] = {}
        self._job_ids: list[str] = []

    def bind(self, jobs: list[dict]) -> None:
        at = 0
        for request, job in zip(self.requests, jobs, strict=True):
            self._position[job["id"]] = at
            at += request["sampling_params"]["n"]
        self._job_ids = [job["id"] for job in jobs]

    def _request(self, job_id: str) -> tuple[dict, dict]:
        i = self._job_ids.index(job_id)
        return self.requests[i], self.options[i]

    def _numbered(self, chunk: dict, job_id: str, choice: int) -> dict:
        if self.numbered:
            chunk["index"] = self._position[job_id] + choice
        return chunk

    def delta(self, job: dict, delta: ChoiceDelta, ledger: TokenLedger) -> list[bytes]:
        request, _ = self._request(job["id"])
        seen = ledger.cumulative(job["id"], delta.index)
        meta: dict[str, Any] = {"id": job.get("request_id") or job["id"], "finish_reason": None,
                                "completion_tokens": len(seen.token_ids), "job_id": job["id"]}
        if request["sampling_params"]["logprobs"]:
            meta["output_token_logprobs"] = [[lp, t, self.texts(t) if self.texts else None]
                                             for lp, t in zip(seen.logprobs, seen.token_ids, strict=False)]
        chunk = {"text": seen.text, "output_ids": list(seen.token_ids), "meta_info": meta}
        return [sse(self._numbered(chunk, job["id"], delta.index))]

    def done(self, job: dict, finals: list[ChoiceDelta], ledger: TokenLedger) -> list[bytes]:
        request, options = self._request(job["id"])
        replies = sglang.job_replies(request, options, job, self.texts)
        return [sse(self._numbered(reply, job["id"], choice)) for choice, reply in enumerate(replies)]

    def end(self, jobs: list[dict]) -> list[bytes]:
        return []

    def error(self, error: RolloutError) -> bytes:
        return sse(sglang_shape(http_status(error), error.code, error.message, error.errors))
