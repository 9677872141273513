"""vLLM's token-in-token-out API: ``POST /inference/v1/generate`` and the render routes that
feed it (``/v1/chat/completions/render``, ``/v1/completions/render``).

Shapes follow vLLM's ``vllm/entrypoints/serve/disagg/protocol.py`` (GenerateRequest,
GenerateResponse, GenerateResponseChoice) and ``serving.py`` (``_create_tokens_logprobs``: tokens
spelled ``token_id:N``; ``logprobs: 0`` still returns the sampled token's logprob, k returns up to
k entries, the sampled token first). Callers replayed in tests: SkyRL and prime-rl render a
conversation, then send ``token_ids`` and ``features`` back to generate without looking inside.

``features`` is ours, opaque to clients: the render's media as content parts (the preprocessing
worker fetches them again through the guarded fetcher, the multimodal cache serving what render
already processed) with vLLM's ``mm_placeholders`` beside them. ``kwargs_data`` is always null:
processed tensors do not travel through clients.
"""

from __future__ import annotations

import hashlib
from typing import Any

from marshmallow import ValidationError, fields, validate, validates_schema

from domain.jobs.results import JobResult
from engine.choice import Choice
from engine.errors import InvalidRequestError
from engine.request_rules import prompt_input_problem
from engine.routing.encoding import nested
from web.api.schemas import ContentPartSchema, StrictBoolean, TokenIds
from web.dialects.common import (
    TokenTexts,
    carry_request_fields,
    native_request,
    prompt_logprobs_of,
    usage,
    vocab_size,
)
from web.dialects.fields import NullMeansDefault, StreamOptionsSchema, refuse_non_default
from web.dialects.openai.request import check_model
from web.dialects.sampling import RENAMED, SAME, native_sampling, sampling_fields

_UNSUPPORTED = {"best_of": (None, 1), "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
                "truncate_prompt_tokens": (None,),
                "logits_processors": (None,), "extra_args": (None, {}), "output_kind": (None, 0),
                "flat_logprobs": (None, False)}
_UNSUPPORTED_TOP = {"priority": (0,), "kv_transfer_params": (None,)}

_SamplingFields = type("_SamplingFields", (NullMeansDefault,), sampling_fields())


class VllmSamplingParamsSchema(_SamplingFields):
    """vLLM's SamplingParams (vllm/sampling_params.py), the knobs served here."""

    max_tokens = fields.Integer(strict=True)
    logprobs = fields.Integer(strict=True, validate=validate.Range(0, 20), metadata={
        "description": "null: none; 0: the sampled token's logprob; k: also the k most likely"})
    detokenize = StrictBoolean()
    best_of = fields.Raw()
    logit_bias = fields.Raw()
    allowed_token_ids = fields.Raw()
    bad_words = fields.Raw()
    structured_outputs = fields.Raw()
    guided_decoding = fields.Raw()
    truncate_prompt_tokens = fields.Raw()
    logits_processors = fields.Raw()
    extra_args = fields.Raw()
    output_kind = fields.Raw()
    flat_logprobs = fields.Raw()

    @validates_schema
    def supported(self, data: dict, **_) -> None:
        refuse_non_default(data, _UNSUPPORTED)


class UnrenderedFeaturesError(InvalidRequestError):
    """``features`` without the media this service's render routes put in them: vLLM's own render
    names media by hashes of tensors this service never made, so there is nothing to run."""

    code = "features_not_rendered_here"


class FeaturesSchema(NullMeansDefault):
    """What our render routes return as ``features`` (pass it back unchanged)."""

    content_parts = fields.List(fields.Nested(ContentPartSchema), validate=validate.Length(max=1024))
    mm_placeholders = fields.Dict()
    mm_hashes = fields.Dict()
    kwargs_data = fields.Raw(validate=validate.Equal(None, error="must be null: processed tensors do not "
                                                     "travel through clients (send content_parts)"))

    @validates_schema
    def rendered_here(self, data: dict, **_) -> None:
        if "content_parts" not in data:
            raise UnrenderedFeaturesError(
                "features carry no content_parts: they were not made by this service's render routes (vLLM's "
                "mm_hashes name processed tensors this service never saw). Render with this service's "
                "/v1/chat/completions/render and pass its features back, or send the media as content_parts",
                errors={"features": {"content_parts": ["missing: render here, or send the media"]}})


class GenerateRequestSchema(NullMeansDefault):
    request_id = fields.String(validate=validate.Length(1, 256))
    token_ids = TokenIds(required=True)
    features = fields.Nested(FeaturesSchema)
    content_parts = fields.List(fields.Nested(ContentPartSchema), validate=validate.Length(max=1024))
    sampling_params = fields.Nested(VllmSamplingParamsSchema, required=True)
    model = fields.String()
    stream = StrictBoolean(metadata={"description": "true: Server-Sent Events chunks, then data: [DONE]"})
    stream_options = fields.Nested(StreamOptionsSchema)
    cache_salt = fields.String(validate=validate.Length(1, 256), metadata={
        "description": "KV blocks are reused only between requests of the same key and the same salt"})
    return_token_ids = StrictBoolean(metadata={
        "description": "The reply's prompt_token_ids and mm_placeholders, also on the first streamed chunk"})
    priority = fields.Integer(strict=True)
    kv_transfer_params = fields.Raw()

    @validates_schema
    def exclusive(self, data: dict, **_) -> None:
        if problem := prompt_input_problem(data):
            field, message = problem
            raise ValidationError(message, field)
        refuse_non_default(data, _UNSUPPORTED_TOP)


def generate_request(body: dict[str, Any]) -> dict[str, Any]:
    check_model(body.get("model"))
    sp = body["sampling_params"]
    params = native_sampling(sp, vocab_size())
    k = sp.get("logprobs")
    params["logprobs"] = k is not None
    if k:
        params["top_logprobs"] = k
    native: dict[str, Any] = {"token_ids": body["token_ids"], "sampling_params": params}
    parts = (body.get("features") or {}).get("content_parts") or body.get("content_parts")
    if parts:
        native["content_parts"] = parts
    carry_request_fields(body, native)
    names = {f"sampling_params.{n}": f"sampling_params.{RENAMED.get(n, n)}" for n in params}
    names["sampling_params.top_logprobs"] = "sampling_params.logprobs"
    return native_request(native, names, vocab_size=vocab_size())


def generate_reply(body: dict[str, Any], request: dict, job: dict) -> dict:
    result = JobResult.of(job, n=request["sampling_params"]["n"])
    k = body["sampling_params"].get("logprobs")
    texts = TokenTexts() if result.prompt_logprobs is not None else None
    choices = [{"index": choice.index, "token_ids": choice.token_ids, "finish_reason": choice.finish_reason,
                "logprobs": {"content": token_logprobs(choice, k)} if k is not None else None,
                "weight_versions": choice.weight_versions or [],  # [{version, start, end}] over token_ids
                "sampling_mask": choice.sampling_mask,  # vLLM's {token_ids, offsets}; null unless asked
                "routed_experts": nested(choice.routed_experts)}  # vLLM's [tokens][layers][k]; null unless asked
               for choice in result.choices]
    # prompt_token_ids: the ids the model consumed (media pads expanded), as vLLM's newer
    # token-in-token-out reply carries them: a trainer that sent one collapsed pad per item learns the real ids.
    return {"request_id": body.get("request_id") or job["id"], "choices": choices,
            "prompt_token_ids": result.prompt_token_ids, "mm_placeholders": mm_placeholders(result.placeholder_ranges),
            "prompt_logprobs": prompt_logprobs_of(result, texts), "usage": usage(result),
            "job_id": job["id"], "weight_version": result.weight_version}


def mm_placeholders(ranges: list[dict]) -> dict[str, list[dict]]:
    """vLLM's ``mm_placeholders`` (per modality, each item's run of placeholder tokens in
    ``prompt_token_ids``) from a result's or stored prompt's ``placeholder_ranges``."""
    out: dict[str, list[dict]] = {}
    for r in ranges or ():
        out.setdefault(r["modality"], []).append({"offset": r["offset"], "length": r["length"]})
    return out


def token_logprobs(choice: Choice, k: int) -> list[dict]:
    """Per sampled token, its logprob and the top ``k`` (at least itself), tokens spelled as ids."""
    tops = choice.top_logprobs or [[] for _ in choice.token_ids]
    out = []
    for token_id, lp, step in zip(choice.token_ids, choice.logprobs or [], tops, strict=True):
        entries = [(token_id, lp)] + [(alt, alt_lp) for alt, alt_lp in step if alt != token_id]
        out.append({"token": f"token_id:{token_id}", "logprob": max(lp, -9999.0),
                    "top_logprobs": [{"token": f"token_id:{t}", "logprob": max(v, -9999.0)}
                                     for t, v in entries[:max(k, 1)]]})
    return out


# --- render --------------------------------------------------------------------------------------


def features_of(token_ids: list[int], content_parts: list[dict], placeholder_id: int | None) -> dict | None:
    """Our opaque ``features``: the content parts, with vLLM's ``mm_placeholders`` (the runs of
    the placeholder token) and a hash per part beside them."""
    if not content_parts:
        return None
    runs, start = [], None
    for i, token in enumerate([*token_ids, None]):
        if token == placeholder_id and start is None:
            start = i
        elif token != placeholder_id and start is not None:
            runs.append({"offset": start, "length": i - start})
            start = None
    hashes = [part.get("uuid") or hashlib.sha256(part["url"].encode()).hexdigest() for part in content_parts]
    return {"content_parts": content_parts, "mm_placeholders": {"image": runs} if runs else {},
            "mm_hashes": {"image": hashes}, "kwargs_data": None}


def render_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The render body's knobs as vLLM SamplingParams, for the client to send to generate."""
    out = {name: body[name] for name in (*SAME, "top_k", "stop") if name in body}
    if "max_completion_tokens" in body or "max_tokens" in body:
        out["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(body.get("logprobs"), bool):
        out["logprobs"] = (body.get("top_logprobs") or 0) if body["logprobs"] else None
    elif body.get("logprobs") is not None:
        out["logprobs"] = body["logprobs"]
    return out
