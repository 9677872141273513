"""SGLang's native ``POST /generate``: the body as SGLang's ``GenerateReqInput``, the reply as its
``/generate`` answer.

Shapes follow sglang's ``python/sglang/srt/managers/io_struct.py`` (GenerateReqInput, its
SamplingParams in ``python/sglang/srt/sampling/sampling_params.py``) and the reply that
``tokenizer_manager.py`` builds (``text``, ``output_ids``, ``meta_info`` with
``finish_reason``, ``output_token_logprobs`` as ``[logprob, token_id, text or None]``). Clients
replayed in tests: slime's ``slime/rollout/sglang_rollout.py`` (``input_ids`` or ``text`` +
``image_data``, ``return_logprob``, reads ``meta_info.output_token_logprobs``); slime's multi-turn
examples and verl's SGLang rollout branch on ``meta_info["finish_reason"]["type"]``.

A batch (``text`` / ``input_ids`` as a list) is one job per prompt; with ``n`` > 1 the reply holds
``n`` entries per prompt, in prompt order.
"""

from __future__ import annotations

from typing import Any

from marshmallow import ValidationError, fields, validate, validates_schema

from domain.jobs.results import JobResult
from engine.choice import Choice
from engine.errors import InvalidRequestError
from engine.routing.encoding import sglang_base64
from engine.sampling_params import LOGPROBS_MODES
from web.api.schemas import StrictBoolean, StrictFloat
from web.dialects.common import TokenTexts, media_url, native_request
from web.dialects.fields import NullMeansDefault, OneOrMany, TokenIdsOrBatch, refuse_non_default
from web.dialects.sampling import top_k_of
from web.dialects.structured import sglang_structured

# SGLang sampling name -> ours.
_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
            "no_stop_trim": "include_stop_str_in_output", "sampling_seed": "seed"}
_SAME = ("temperature", "top_p", "min_p", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
         "spaces_between_special_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "n",
         "max_policy_lag", "logprobs_mode")
# SGLang knobs we cannot honour: accepted only at their defaults.
_UNSUPPORTED_SAMPLING = {"structural_tag": (None,), "stop_regex": (None,), "logit_bias": (None, {}),
                         "custom_params": (None, {})}
_UNSUPPORTED_TOP = {"return_hidden_states": (False,),
                    "custom_logit_processor": (None,), "session_params": (None,), "input_embeds": (None,),
                    "token_ids_logprob": (None,), "bootstrap_host": (None,), "bootstrap_port": (None,),
                    "bootstrap_room": (None,), "data_parallel_rank": (None,)}
_MEDIA = (("image_data", "image_url"), ("video_data", "video_url"), ("audio_data", "audio_url"))


class SglangSamplingParamsSchema(NullMeansDefault):
    max_new_tokens = fields.Integer(strict=True)
    min_new_tokens = fields.Integer(strict=True)
    temperature = StrictFloat(allow_nan=False)
    top_p = StrictFloat(allow_nan=False)
    top_k = fields.Integer(strict=True, metadata={"description": "-1, 0 or >= the vocabulary: off"})
    min_p = StrictFloat(allow_nan=False)
    stop = OneOrMany(fields.String())
    stop_token_ids = fields.List(fields.Integer(strict=True))
    ignore_eos = StrictBoolean()
    skip_special_tokens = StrictBoolean()
    spaces_between_special_tokens = StrictBoolean()
    no_stop_trim = StrictBoolean()
    repetition_penalty = StrictFloat(allow_nan=False)
    frequency_penalty = StrictFloat(allow_nan=False)
    presence_penalty = StrictFloat(allow_nan=False)
    n = fields.Integer(strict=True)
    sampling_seed = fields.Integer(strict=True)
    max_policy_lag = fields.Integer(strict=True, metadata={"description": "ours: weight updates a row may cross"})
    logprobs_mode = fields.String(validate=validate.OneOf(LOGPROBS_MODES), metadata={
        "description": "ours: raw (default) or processed (the distribution each token was drawn from)"})
    json_schema = fields.Raw(metadata={"description": "A JSON schema (its JSON text, or $$ANY$$ for any JSON object)"})
    regex = fields.String(metadata={"description": "The output matches this regex"})
    ebnf = fields.String(metadata={"description": "The output follows this EBNF grammar (xgrammar's)"})
    structural_tag = fields.Raw()
    stop_regex = fields.Raw()
    logit_bias = fields.Raw()
    custom_params = fields.Raw()

    @validates_schema(pass_original=True)
    def supported(self, data: dict, original: Any, **_) -> None:
        refuse_non_default(data, _UNSUPPORTED_SAMPLING)


class SglangGenerateSchema(NullMeansDefault):
    """sglang io_struct.GenerateReqInput, the fields this service serves."""

    text = OneOrMany(fields.String(), metadata={"description": "A prompt, or a list of prompts (a batch)"})
    input_ids = TokenIdsOrBatch(metadata={"description": "Token ids, or a list of them (a batch)"})
    image_data = fields.Raw(metadata={"description": "URL, data URL or raw base64; a list per prompt; a list of "
                                                      "lists for a batch"})
    video_data = fields.Raw()
    audio_data = fields.Raw()
    sampling_params = OneOrMany(fields.Nested(SglangSamplingParamsSchema),
                                metadata={"description": "One for all prompts, or one per prompt"})
    rid = OneOrMany(fields.String(validate=validate.Length(1, 256)))
    return_logprob = OneOrMany(StrictBoolean())
    logprob_start_len = OneOrMany(fields.Integer(strict=True, validate=validate.Range(-1, 10**7)))
    top_logprobs_num = OneOrMany(fields.Integer(strict=True, validate=validate.Range(0, 20)))
    return_sampling_mask = OneOrMany(StrictBoolean(), metadata={
        "description": "meta_info.output_token_sampling_mask: per output token, the ids it could have been drawn from"})
    return_text_in_logprobs = StrictBoolean()
    stream = StrictBoolean(metadata={"description": "true: Server-Sent Events, cumulative chunks as SGLang sends "
                                                    "them, then data: [DONE]"})
    log_metrics = StrictBoolean()
    modalities = fields.Raw()
    return_hidden_states = fields.Raw()
    return_routed_experts = OneOrMany(StrictBoolean(), metadata={
        "description": "meta_info.routed_experts: base64 of int32 ids, (prompt + output - 1, MoE layers, top-k)"})
    routed_experts_start_len = OneOrMany(fields.Integer(strict=True, validate=validate.Range(0, 10**7)), metadata={
        "description": "meta_info.routed_experts from this position on (a next turn's new part)"})
    lora_path = fields.Raw()
    custom_logit_processor = fields.Raw()
    session_params = fields.Raw()
    input_embeds = fields.Raw()
    token_ids_logprob = fields.Raw()
    bootstrap_host = fields.Raw()
    bootstrap_port = fields.Raw()
    bootstrap_room = fields.Raw()
    data_parallel_rank = fields.Raw()

    @validates_schema
    def one_prompt_kind(self, data: dict, **_) -> None:
        if ("text" in data) == ("input_ids" in data):
            raise ValidationError("give exactly one of text or input_ids", "text")
        modalities = data.get("modalities")
        if modalities is not None and (not isinstance(modalities, list) or any(m != "image" for m in modalities)):
            # SGLang's modalities say how to read image_data (multi-images, video frames): here media
            # kinds have their own fields, and a video goes as video_data.
            raise ValidationError("only 'image' entries: send videos as video_data", "modalities")
        refuse_non_default(data, _UNSUPPORTED_TOP)


def to_requests(body: dict[str, Any], *, vocab_size: int | None) -> tuple[list[dict[str, Any]], list[dict], bool]:
    """The native requests of a loaded SGLang body (one per prompt), each prompt's reply options
    (which logprobs to show) and whether it was a batch."""
    prompts, key = (body["text"], "prompt") if "text" in body else (body["input_ids"], "token_ids")
    batch = isinstance(prompts, list) and (key == "prompt" or isinstance(prompts[0], list))
    prompts = prompts if batch else [prompts]
    size = len(prompts)
    if size == 0:
        raise InvalidRequestError("an empty batch", errors={"text" if key == "prompt" else "input_ids": ["empty"]})
    per = {name: _per_item(body, name, size, batch) for name in
           ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
            "return_sampling_mask", "lora_path", "return_routed_experts", "routed_experts_start_len")}
    media = {name: _media_per_item(body.get(name), name, size, batch) for name, _ in _MEDIA}
    requests, options = [], []
    for i, prompt in enumerate(prompts):
        where = f"[{i}]" if batch else ""
        params = _sampling(per["sampling_params"][i] or {}, vocab_size)
        logprobs = bool(per["return_logprob"][i])
        params["logprobs"] = logprobs
        if per["return_sampling_mask"][i]:
            params["sampling_mask"] = True
        if per["return_routed_experts"][i]:
            params["routed_experts"] = True
        top = per["top_logprobs_num"][i] or 0
        start = per["logprob_start_len"][i]
        if logprobs:
            params["top_logprobs"] = top
            if start is not None and start >= 0:
                params["prompt_logprobs"] = top
        native: dict[str, Any] = {key: prompt, "sampling_params": params}
        parts = [{"type": kind, "url": media_url(url, f"{name}{where}[{j}]")}
                 for name, kind in _MEDIA for j, url in enumerate(media[name][i])]
        if parts:
            native["content_parts"] = parts
        if per["rid"][i] is not None:
            native["request_id"] = per["rid"][i]
        if per["lora_path"][i] is not None:  # SGLang names a loaded adapter by its lora_name here
            native["adapter"] = per["lora_path"][i]
        names = {"sampling_params.max_tokens": "sampling_params.max_new_tokens",
                 "sampling_params.min_tokens": "sampling_params.min_new_tokens",
                 "sampling_params.include_stop_str_in_output": "sampling_params.no_stop_trim",
                 "sampling_params.seed": "sampling_params.sampling_seed", "token_ids": "input_ids",
                 "sampling_params.sampling_mask": "return_sampling_mask",
                 "sampling_params.routed_experts": "return_routed_experts",
                 "prompt": "text", "request_id": "rid", "content_parts": "image_data", "adapter": "lora_path"}
        requests.append(native_request(native, {k: _indexed(v, where) for k, v in names.items()}, vocab_size=vocab_size))
        options.append({"logprob_start_len": start, "top_logprobs_num": top,
                        "routed_experts_start_len": per["routed_experts_start_len"][i] or 0})
    return requests, options, batch


def _indexed(name: str, where: str) -> str:
    """A field of one item of a batch, as the client wrote it: ``sampling_params[2].top_k``, ``input_ids[2]``."""
    head, dot, rest = name.partition(".")
    return f"{head}{where}{dot}{rest}"


def _per_item(body: dict, name: str, size: int, batch: bool) -> list:
    value = body.get(name)
    if not batch and isinstance(value, list):
        # One prompt: a one-element list is its value (as a batch of one would be); more is an error,
        # never a value silently dropped or a list where a number goes.
        if len(value) != 1:
            raise InvalidRequestError(f"{name}: {len(value)} values for one prompt",
                                      errors={name: ["one prompt takes one value (or a list of one)"]})
        return value
    if not batch or not isinstance(value, list):
        if batch and name == "rid" and value is not None:
            raise InvalidRequestError("rid: a batch needs one rid per prompt", errors={"rid": ["must be a list"]})
        return [value] * size
    if len(value) != size:
        raise InvalidRequestError(f"{name}: {len(value)} values for {size} prompts",
                                  errors={name: [f"must have one value per prompt ({size})"]})
    return value


def _media_per_item(value: Any, name: str, size: int, batch: bool) -> list[list]:
    """SGLang's media fields: one item or a list for a prompt; for a batch, one entry per prompt,
    each a single item, a list, or null."""
    if value is None:
        return [[] for _ in range(size)]
    if not batch:
        return [value if isinstance(value, list) else [value]]
    if not isinstance(value, list) or len(value) != size:
        raise InvalidRequestError(f"{name}: a batch needs one entry per prompt",
                                  errors={name: [f"must be a list of {size} entries"]})
    return [[] if item is None else item if isinstance(item, list) else [item] for item in value]


def _sampling(params: dict[str, Any], vocab_size: int | None) -> dict[str, Any]:
    out = {ours: params[theirs] for theirs, ours in _RENAMED.items() if theirs in params}
    out.update({name: params[name] for name in _SAME if name in params})
    if (constraint := sglang_structured(params)) is not None:
        out["structured_output"] = constraint
    if "top_k" in params:
        out["top_k"] = top_k_of(params["top_k"], vocab_size)
    return out


# --- the reply ----------------------------------------------------------------------------------


def replies(requests: list[dict[str, Any]], options: list[dict], jobs: list[dict[str, Any]], *,
            return_text: bool) -> list[dict]:
    """One reply per choice, prompt by prompt, each prompt's n choices together."""
    texts = TokenTexts() if return_text else None
    out = []
    for request, option, job in zip(requests, options, jobs, strict=True):
        out.extend(_job_replies(request, option, job, texts))
    return out


def job_replies(request: dict, options: dict, job: dict, texts) -> list[dict]:
    """The replies of one job, one per choice (the non-streamed reply, and a stream's last chunks)."""
    return _job_replies(request, options, job, texts)


def _job_replies(request: dict, options: dict, job: dict, texts) -> list[dict]:
    params = request["sampling_params"]
    result = JobResult.of(job, n=params["n"])
    prompt_ids = result.prompt_token_ids
    latency = (job.get("completed_at") or 0) - (job.get("created_at") or 0)
    out = []
    for choice in result.choices:
        meta: dict[str, Any] = {
            "id": job.get("request_id") or job["id"],
            "finish_reason": _finish_reason(choice, job),
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(choice.token_ids),
            # Prompt tokens whose KV came from a group sibling or the recent-prompt cache.
            "cached_tokens": result.cached_tokens,
            "weight_version": result.weight_version,
            # [{version, start, end}], half-open over output_ids: a row kept across an update has several.
            "weight_versions": choice.weight_versions or [],
            "e2e_latency": round(max(latency, 0.0), 6),
            "job_id": job["id"],
        }
        if params["logprobs"]:
            meta.update(_logprobs(choice, result, prompt_ids, options, texts))
        if params.get("sampling_mask"):
            meta["output_token_sampling_mask"] = sampling_mask_rows(choice.sampling_mask)
        if params.get("routed_experts"):  # SGLang's encoding, sent once the job ended (engine/routing/)
            meta["routed_experts"] = sglang_base64(choice.routed_experts, options.get("routed_experts_start_len") or 0)
        out.append({"text": choice.text or "", "output_ids": choice.token_ids, "meta_info": meta})
    return out


def sampling_mask_rows(mask: dict | None) -> list[list[int]]:
    """SGLang's ``output_token_sampling_mask`` (a list of ids per output token) from the engine's
    CSR ``{token_ids, offsets}`` (``engine.choice.Choice.sampling_mask``)."""
    if not mask:
        return []
    ids, offsets = mask["token_ids"], mask["offsets"]
    return [ids[start:end] for start, end in zip(offsets, offsets[1:], strict=False)]


def _finish_reason(choice: Choice, job: dict) -> dict:
    reason = choice.finish_reason
    if reason == "length":
        return {"type": "length", "length": len(choice.token_ids)}
    if reason == "stop":
        return {"type": "stop", "matched": choice.matched_stop}
    if reason == "policy_lag":  # SGLang's types are stop, length and abort: trainers branch on them
        return {"type": "abort", "message": "policy_lag: it would cross more weight updates than max_policy_lag"}
    return {"type": "abort", "message": "aborted" if job["status"] == "cancelled" else "ended early"}


def _entry(logprob, token_id: int, texts) -> list:
    return [logprob, token_id, texts(token_id) if texts else None]


def _logprobs(choice: Choice, result: JobResult, prompt_ids: list[int], options: dict, texts) -> dict:
    ids = choice.token_ids
    out: dict[str, Any] = {
        "output_token_logprobs": [_entry(lp, t, texts) for lp, t in zip(choice.logprobs or [], ids, strict=True)],
        "output_top_logprobs": [[_entry(lp, t, texts) for t, lp in step] for step in choice.top_logprobs or []]
        if options["top_logprobs_num"] else [],
    }
    start = options["logprob_start_len"]
    if start is not None and start >= 0 and result.prompt_logprobs is not None:
        lps = result.prompt_logprobs
        out["input_token_logprobs"] = [_entry(lps[i], prompt_ids[i], texts) for i in range(start, len(prompt_ids))]
        tops = result.prompt_top_logprobs or []
        out["input_top_logprobs"] = [
            [_entry(lp, t, texts) for t, lp in (tops[i] or [])] if i < len(tops) else None
            for i in range(start, len(prompt_ids))] if options["top_logprobs_num"] else []
    else:
        out["input_token_logprobs"], out["input_top_logprobs"] = [], []
    return out
