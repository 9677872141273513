"""What every dialect shares: validate a native request, run jobs synchronously, read tokens.

A dialect maps its body to the native request dict (the one ``JobRequestSchema`` produces), runs
it here through the one submit path (``web.api.submit``), and maps the finished jobs to its reply.
Dialect clients do not understand a 202 with a job object, so a job still running after
``ROLLOUT_SYNC_TIMEOUT_MAX`` seconds is cancelled and the call answers 504 (:class:`SyncTimeoutError`).
"""

from __future__ import annotations

import re
import time
from typing import Any

import flask
from marshmallow import ValidationError

from domain.jobs.store import TERMINAL
from domain.lifecycle import cancel_job
from engine.errors import Fault, InvalidRequestError, NotFoundError, RolloutError, TokenIdOutOfRangeError
from engine.routing.shape import check_routing_asked
from web.api.schemas import TOKENIZER_MADE, JobRequestSchema
from web.api.submit import check_vocabulary, checked_request, submit_checked
from web.auth import current_owner
from web.dialects.errors import flatten
from web.services import services
from web.serving.client_gone import hung_up_check

_NATIVE = JobRequestSchema()
_HANG_UP_CHECK_S = 1.0  # how often a synchronous call looks whether its client is still there
# A URL starts with a scheme; base64's alphabet has no ':' at all.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]{0,15}:")
_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")


class ClientClosedRequestError(RolloutError):
    """The client hung up before its synchronous call was answered (nobody reads the answer)."""

    code = "client_closed_request"
    fault = Fault.CANCELLED


class SyncTimeoutError(RolloutError):
    """The jobs of a synchronous dialect call did not end within ROLLOUT_SYNC_TIMEOUT_MAX."""

    code = "sync_timeout"
    fault = Fault.DEADLINE_EXCEEDED
    retryable = True


def job_error(job: dict) -> RolloutError:
    """The typed error a failed job ended with (its type, and so its status, by its code)."""
    return RolloutError.from_record(job.get("error") or {})


def usage(*results) -> dict[str, Any]:
    """OpenAI's ``usage`` of jobs' results (``domain.jobs.results.JobResult``), with the prompt
    tokens their KV came from cache for (``prompt_tokens_details.cached_tokens``, as OpenAI and
    vLLM name it)."""
    prompt, completion = sum(r.prompt_tokens for r in results), sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)}}


def carry_request_fields(body: dict[str, Any], native: dict[str, Any]) -> dict[str, Any]:
    """``native`` with the dialect body's request id, cache salt and session id, which mean what
    they mean natively."""
    for name in ("request_id", "cache_salt", "session_id"):
        if body.get(name):
            native[name] = body[name]
    return native


def native_request(body: dict[str, Any], names: dict[str, str] | None = None, *,
                   vocab_size: int | None = None, tokenized: bool = False) -> dict[str, Any]:
    """``body`` (native field names) validated and defaulted by the native schema, its token ids
    checked against ``vocab_size`` when given. ``names`` maps native field paths back to the
    dialect's, so errors name what the client sent. ``tokenized``: the body's ``token_ids`` are
    the ids our tokenizer made (web.api.schemas.TOKENIZER_MADE)."""
    made = TOKENIZER_MADE.set(body["token_ids"] if tokenized else None)
    try:
        request = _NATIVE.load(body)
    except ValidationError as exc:
        errors = _rename(exc.messages, names or {})
        raise InvalidRequestError("invalid fields: " + ", ".join(sorted(errors)), errors=errors) from None
    finally:
        TOKENIZER_MADE.reset(made)
    try:
        check_vocabulary(request, vocab_size)  # submit checks again, naming native fields
    except TokenIdOutOfRangeError as error:
        (field,) = _rename({error.field: None}, names or {})
        raise TokenIdOutOfRangeError(field=field, index=error.index, token_id=error.token_id,
                                     vocab_size=error.vocab_size) from None
    params = request.get("sampling_params") or {}
    if params.get("routed_experts"):  # submit checks again, naming native fields
        try:
            check_routing_asked(params, services().model_facts.routed_bytes_per_token)
        except InvalidRequestError as error:
            raise InvalidRequestError(error.message, errors=_rename(error.errors, names or {})) from None
    return request


def run_jobs(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Submit every request (one job each, owned by the caller), wait for all, return the ended
    jobs in order. All are checked before any is made (a refused one raises its own error) and a
    batch's jobs are made together (``web.api.submit.submit_checked``); one the queue caps refuse
    raises, the others cancelled. A failed job raises its own error; the rest are cancelled when
    one fails, time runs out or the client hangs up, since the client gets no job link to follow
    them."""
    svc, hung_up = services(), hung_up_check()
    outcomes = submit_checked([checked_request(request) for request in requests])
    jobs = [job for job in outcomes if not isinstance(job, RolloutError)]
    if len(jobs) < len(outcomes):
        _cancel(jobs)
        raise next(error for error in outcomes if isinstance(error, RolloutError))
    deadline = time.monotonic() + svc.settings.sync_timeout_max
    finished: dict[str, dict[str, Any]] = {}
    while len(finished) < len(jobs):
        running = [job["id"] for job in jobs if job["id"] not in finished]
        ended = svc.jobs.wait_any(running, timeout=min(deadline - time.monotonic(), _HANG_UP_CHECK_S))
        for job_id, done in ended.items():
            if done is None:
                _cancel(jobs)
                raise NotFoundError(f"no job {job_id!r}")  # expired under the wait: not seen in practice
            if done["status"] == "failed":
                _cancel(jobs)
                raise job_error(done)
            finished[job_id] = done
        if ended:
            continue
        if hung_up():
            _cancel(jobs)
            raise ClientClosedRequestError("the client closed the connection; its jobs were cancelled")
        if time.monotonic() >= deadline:
            _cancel(jobs)
            raise SyncTimeoutError(f"the job did not finish within {svc.settings.sync_timeout_max:g} s "
                                   f"(ROLLOUT_SYNC_TIMEOUT_MAX); it was cancelled")
    return [finished[job["id"]] for job in jobs]


def _cancel(jobs: list[dict[str, Any]]) -> None:
    svc, owner = services(), current_owner()
    for job in jobs:
        try:
            if svc.jobs.get(job["id"], owner=owner)["status"] not in TERMINAL:
                cancel_job(svc, job["id"], owner=owner)
        except RolloutError:
            pass  # expired or gone: nothing left to cancel


def media_url(value: Any, where: str) -> str:
    """A media reference as a URL for the guarded fetcher: URLs and data: URLs as they are, raw
    base64 (SGLang and OpenAI's input_audio send it) as a data: URL, so the fetcher's size cap
    applies before decoding as for any data: URL."""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where}: must be a non-empty string", errors={where: ["must be a URL or base64"]})
    if _SCHEME.match(value):
        return value
    if _BASE64.match(value):
        return "data:application/octet-stream;base64," + value
    raise InvalidRequestError(f"{where}: neither a URL nor base64 (file names are not read; use a file: URL "
                              "under ROLLOUT_MEDIA_ROOT)", errors={where: ["must be a URL, a data: URL or base64"]})


def tokenizer():
    """The model's tokenizer, loaded once per API process."""
    return services().tokenizer


def token_ids_of(texts: list[str], *, add_special_tokens: bool, tok=None) -> list[list[int]]:
    """Each text's ids as ``tokenizer()(text, add_special_tokens=...)["input_ids"]`` gives them, in
    one call: a fast tokenizer encodes a batch on all cores. Pass ``tok`` (``tokenizer()``) to call
    it outside the request's thread."""
    tok = tokenizer() if tok is None else tok
    if _wrapper_adds_nothing(tok):
        # transformers' batched call runs the Rust ``encode_batch``, which also tracks each token's
        # character offsets (a quarter of its time on chat prompts) only to drop them here;
        # ``encode_batch_fast`` is the same encoding without offsets.
        encodings = tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]
    return tok(texts, add_special_tokens=add_special_tokens, return_attention_mask=False,
               return_token_type_ids=False)["input_ids"]


def _wrapper_adds_nothing(tok) -> bool:
    """Whether transformers' call on ``tok`` is its Rust backend's encoding as is: its own code (no
    tokenizer class of the model's), no input mode to switch, and the backend with no truncation or
    padding left set and special tokens split as the call would set them."""
    from transformers import PreTrainedTokenizerBase, TokenizersBackend  # loaded with the tokenizer already

    if type(tok).__call__ is not PreTrainedTokenizerBase.__call__ or hasattr(tok, "_switch_to_input_mode"):
        return False
    if type(tok)._encode_plus is not TokenizersBackend._encode_plus:
        return False
    backend = tok.backend_tokenizer
    return (backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == tok.split_special_tokens)


def vocab_size() -> int | None:
    return services().model_facts.vocab_size


class TokenTexts:
    """Each token's own text (what OpenAI's ``tokens`` and SGLang's logprob texts show), decoded
    once per id per reply."""

    def __init__(self):
        self._tokenizer = tokenizer()
        self._seen: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._seen.get(token_id)
        if text is None:
            text = self._seen[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def served_model_name() -> str:
    from domain.models import model_id

    settings = services().settings
    return settings.served_model_name or model_id(settings)


def reply_model_name() -> str:
    """A reply's ``model``: the LoRA adapter the request named (vLLM's), else the served model."""
    return (flask.g.get("lora_adapter") if flask.has_request_context() else None) or served_model_name()


def _rename(messages: Any, names: dict[str, str]) -> dict[str, Any]:
    """marshmallow's nested messages as dotted paths, native names replaced by the dialect's."""
    out = {}
    for path, value in flatten(messages).items():
        for native, dialect in names.items():
            if path == native or path.startswith(native + "."):
                path = dialect + path[len(native):]
                break
        out[path] = value
    return out


def prompt_logprobs_of(result, texts) -> list | None:
    """A result's prompt logprobs in vLLM's shape (its generate route, and the OpenAI routes' vLLM
    extra ``prompt_logprobs``): per prompt position ``{token_id: {logprob, rank, decoded_token}}`` (the
    prompt token and the top k), ``None`` for the first."""
    lps = result.prompt_logprobs
    if lps is None:
        return None
    ids, tops = result.prompt_token_ids, result.prompt_top_logprobs or []
    out: list[dict | None] = []
    for i, (token_id, lp) in enumerate(zip(ids, lps, strict=True)):
        if lp is None:
            out.append(None)
            continue
        step = {str(token_id): {"logprob": lp, "rank": None, "decoded_token": texts(token_id)}}
        for rank, (alt, alt_lp) in enumerate((tops[i] if i < len(tops) else None) or [], start=1):
            entry = {"logprob": alt_lp, "rank": rank, "decoded_token": texts(alt)}
            if str(alt) in step:
                step[str(alt)]["rank"] = rank
            else:
                step[str(alt)] = entry
        out.append(step)
    return out
