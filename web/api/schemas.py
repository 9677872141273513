"""Request and response schemas (marshmallow). The OpenAPI document is generated from these.

Requests are flat, in the spirit of vLLM's token-in-token-out ``/generate`` and SGLang's
``/generate``, under our own names only (the dialects in ``web/dialects`` speak theirs). Unknown
fields are rejected by name (marshmallow's RAISE), never silently dropped.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from marshmallow import ValidationError, fields, pre_load, validate, validates_schema

from engine.request_rules import prompt_input_problem, sampling_knob_problems
from engine.sampling_params import LOGPROBS_MODES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from web.api import session_header
from web.api.long_poll import wait_field
from web.schema_base import Schema

JOB_KINDS = ("generate", "score")
JOB_STATUSES = ("queued", "preprocessing", "generating", "succeeded", "failed", "cancelled")
JOB_EVENTS = ("job.succeeded", "job.failed", "job.cancelled")
CONTENT_TYPES = ("image_url", "video_url", "audio_url")
MAX_TOKEN_ID = 2**31 - 1

class StrictFloat(fields.Float):
    """A JSON number only: marshmallow's Float also takes strings ("1") and booleans."""

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


class StrictBoolean(fields.Boolean):
    """``true`` or ``false`` only: marshmallow's Boolean also takes "yes", "1", 1 and the like."""

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, bool):
            raise self.make_error("invalid")
        return value


def refuse_recompute_kv_outside_keep(data: dict) -> None:
    """The weights and adapters update routes: ``recompute_kv`` changes nothing outside mode keep,
    so it is refused by name, not ignored."""
    if data.get("recompute_kv") and data.get("mode") != "keep":
        raise ValidationError("only with mode keep (the rows carried over to the new weights)", "recompute_kv")


TokenId = fields.Integer(strict=True, validate=validate.Range(0, MAX_TOKEN_ID))


# The list of ids (this very object) our tokenizer made for the body being loaded, if any
# (web.dialects.common.native_request): the Rust tokenizer's ids are plain ints from 0, so the
# per-id pass below is skipped for them, an eighth of checking a chat line of 564 ids. A list that
# came in a request is never this object.
TOKENIZER_MADE: ContextVar[list[int] | None] = ContextVar("tokenizer_made_ids", default=None)


class TokenIds(fields.List):
    """A list of token ids, checked in one pass.

    ``fields.List(fields.Integer(...))`` runs marshmallow's field machinery once per item: ~1.6 µs a
    token, 6.7 ms for a 4k-token RL prompt (0.2 ms here). A list of in-range plain ints (every valid
    request) is taken as is; anything else goes through the per-item fields for their exact errors.
    """

    def __init__(self, **kwargs):
        super().__init__(fields.Integer(strict=True, validate=validate.Range(0, MAX_TOKEN_ID)),
                         validate=validate.Length(min=1, max=1_000_000), **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if value is TOKENIZER_MADE.get():
            return value  # ints from 0 by construction; the length is still checked
        if (type(value) is list and value and set(map(type, value)) == {int}  # bools are no ids
                and min(value) >= 0 and max(value) <= MAX_TOKEN_ID):
            return value
        return super()._deserialize(value, attr, data, **kwargs)


class NumberList(fields.List):
    """A list of numbers in a response (token ids, logprobs), each written as its field would write it.

    ``fields.List`` dumps each item through its field (two calls an item): two fifths of dumping a
    step's lookup of 64 jobs (6,400 numbers) went there. This converts each in one expression, as
    ``fields.Number`` does (None stays None). Loading is ``fields.List``'s own.
    """

    def __init__(self, inner: fields.Number, **kwargs):
        if not isinstance(inner, fields.Number) or inner.as_string:
            raise TypeError("NumberList holds numbers written as numbers")
        super().__init__(inner, **kwargs)

    def _serialize(self, value, attr, obj, **kwargs):
        if value is None:
            return None
        convert = self.inner.num_type
        return [None if item is None else convert(item) for item in value]


class ContentPartSchema(Schema):
    type = fields.String(required=True, validate=validate.OneOf(CONTENT_TYPES))
    url = fields.String(required=True, validate=validate.Length(min=1, max=64 * 1024 * 1024))
    uuid = fields.String(validate=validate.Length(min=1, max=256))


class FeatureTensorSchema(Schema):
    dtype = fields.String(required=True, validate=validate.OneOf(("float32", "float16", "bfloat16", "int64", "int32")))
    shape = fields.List(fields.Integer(strict=True, validate=validate.Range(0, 2**31)), required=True,
                        validate=validate.Length(min=0, max=8))
    data = fields.String(required=True, metadata={"description": "base64 of the raw little-endian bytes"})


class FeatureItemSchema(Schema):
    modality = fields.String(required=True, validate=validate.OneOf(("image", "video", "audio")))
    tensors = fields.Dict(keys=fields.String(validate=validate.Length(1, 64)),
                          values=fields.Nested(FeatureTensorSchema), required=True,
                          validate=validate.Length(min=1, max=16))


class SamplingParamsSchema(Schema):
    max_tokens = fields.Integer(strict=True, validate=validate.Range(1, 1_000_000),
                                metadata={"description": "Alias: max_new_tokens. Default: ROLLOUT_DEFAULT_MAX_TOKENS"})
    temperature = StrictFloat(allow_nan=False, validate=validate.Range(0, 100), load_default=1.0,
                               metadata={"description": "0 means greedy"})
    top_p = StrictFloat(allow_nan=False, validate=validate.Range(0, 1, min_inclusive=False), load_default=1.0)
    top_k = fields.Integer(strict=True, validate=validate.Range(-1, 1_000_000), load_default=-1,
                           metadata={"description": "-1 or 0 turns it off"})
    min_p = StrictFloat(allow_nan=False, validate=validate.Range(0, 1), load_default=0.0)
    seed = fields.Integer(strict=True, validate=validate.Range(0, 2**63 - 1), allow_none=True, load_default=None)
    n = fields.Integer(strict=True, validate=validate.Range(1, 64), load_default=1)
    stop_token_ids = fields.List(TokenId, validate=validate.Length(max=256), load_default=list)
    ignore_eos = StrictBoolean(load_default=False)
    logprobs = StrictBoolean(load_default=True, metadata={"description": "Logprob of each sampled token"})
    # The knobs below mirror engine.sampling_params.SamplingParams field for field (same names, same
    # bounds); the engine checks them again, so nothing accepted here is dropped later.
    stop = fields.List(fields.String(validate=validate.Length(1, MAX_STOP_STRING_CHARS)),
                       validate=validate.Length(max=MAX_STOP_STRINGS), load_default=list,
                       metadata={"description": "Strings that end a choice when they appear in its text "
                                                "(a single string is taken as a list of one)"})
    include_stop_str_in_output = StrictBoolean(load_default=False, metadata={
        "description": "Keep the matched stop string (or stop token's text) in the returned text"})
    min_tokens = fields.Integer(strict=True, validate=validate.Range(0, 1_000_000), load_default=0, metadata={
        "description": "No eos, stop id or stop string ends a choice before this many tokens"})
    repetition_penalty = StrictFloat(allow_nan=False, validate=validate.Range(0, 2, min_inclusive=False),
                                      load_default=1.0, metadata={"description": "vLLM's; 1 turns it off"})
    frequency_penalty = StrictFloat(allow_nan=False, validate=validate.Range(-2, 2), load_default=0.0)
    presence_penalty = StrictFloat(allow_nan=False, validate=validate.Range(-2, 2), load_default=0.0)
    top_logprobs = fields.Integer(strict=True, validate=validate.Range(0, MAX_TOP_LOGPROBS), load_default=0,
                                  metadata={"description": "Per token, this many most likely tokens with their "
                                                           "logprobs (raw distribution)"})
    prompt_logprobs = fields.Integer(strict=True, validate=validate.Range(0, MAX_TOP_LOGPROBS), allow_none=True,
                                     load_default=None, metadata={
                                         "description": "null: none; k: each prompt token's logprob and the top k"})
    detokenize = StrictBoolean(load_default=True, metadata={"description": "Return each choice's text"})
    skip_special_tokens = StrictBoolean(load_default=True)
    spaces_between_special_tokens = StrictBoolean(load_default=True)
    logprobs_mode = fields.String(validate=validate.OneOf(LOGPROBS_MODES), load_default="raw", metadata={
        "description": "raw: logprobs of the model's distribution; processed: of the one each token was drawn "
                       "from (after penalties, temperature, top-k/p, min-p)"})
    sampling_mask = StrictBoolean(load_default=False, metadata={
        "description": "Per token, the ids it could have been drawn from (choices[].sampling_mask, CSR)"})
    routed_experts = StrictBoolean(load_default=False, metadata={
        "description": "MoE models: every position's top-k expert ids per MoE layer (choices[].routed_experts: "
                       "{dtype, shape [prompt + output - 1, layers, k], data: base64})"})
    max_policy_lag = fields.Integer(strict=True, validate=validate.Range(0, 1_000_000), allow_none=True,
                                    load_default=None, metadata={
                                        "description": "Weight updates (mode keep) a row may live through; one "
                                                       "more ends it with finish_reason policy_lag. null: no bound"})
    # Checked by engine.grammar.spec (through SamplingParams): typed 422s invalid_grammar, grammar_too_complex.
    structured_output = fields.Dict(keys=fields.String(), allow_none=True, load_default=None, metadata={
        "description": "A constraint every token obeys: one of {json_schema: {...}}, {json_object: true}, "
                       "{regex: str}, {choice: [str]}, {grammar: EBNF str}"})

    @pre_load
    def accept_aliases(self, data: Any, **_) -> Any:
        if isinstance(data, dict) and "max_new_tokens" in data:
            data = dict(data)
            if "max_tokens" in data:
                raise ValidationError("give max_tokens or max_new_tokens, not both", "max_new_tokens")
            data["max_tokens"] = data.pop("max_new_tokens")
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @validates_schema
    def consistent_knobs(self, data: dict, **_) -> None:
        if problems := sampling_knob_problems(data):
            raise ValidationError({field: [problem] for field, problem in problems.items()})


class WebhookSchema(Schema):
    url = fields.Url(required=True, schemes={"http", "https"}, require_tld=False)
    events = fields.List(fields.String(validate=validate.OneOf(JOB_EVENTS)), validate=validate.Length(min=1))


def _default_sampling_params() -> dict[str, Any]:
    # Loaded once; each request gets a fresh copy (check_limits fills in max_tokens). Building a
    # SamplingParamsSchema per request cost ~0.1 ms, half of validating a score line.
    return {**_SAMPLING_DEFAULTS, "stop_token_ids": [], "stop": []}


_SAMPLING_DEFAULTS = SamplingParamsSchema().load({})


class JobRequestSchema(Schema):
    kind = fields.String(validate=validate.OneOf(JOB_KINDS), load_default="generate")
    token_ids = TokenIds()
    prompt = fields.String(validate=validate.Length(min=1, max=4_000_000))
    content_parts = fields.List(fields.Nested(ContentPartSchema), validate=validate.Length(max=1024))
    features = fields.List(fields.Nested(FeatureItemSchema), validate=validate.Length(min=1, max=1024))
    sampling_params = fields.Nested(SamplingParamsSchema, load_default=_default_sampling_params)
    completion_token_ids = TokenIds(metadata={"description": "kind=score: the tokens to score"})
    request_id = fields.String(validate=validate.Length(min=1, max=256))
    cache_salt = fields.String(validate=validate.Length(min=1, max=256), metadata={
        "description": "KV blocks are reused only between requests of the same key and the same salt"})
    session_id = fields.String(validate=[validate.Length(min=1, max=session_header.MAX_LENGTH),
                                      session_header.validate_session_id], metadata={
        "description": "An agent's turns: kept on one GPU worker (also the X-Session-ID header); "
                       "visible ASCII, spaces only inside"})
    webhook = fields.Nested(WebhookSchema)
    metadata = fields.Dict(keys=fields.String(), metadata={"description": "At most ROLLOUT_MAX_METADATA_BYTES as JSON"})
    adapter = fields.String(validate=validate.Length(min=1, max=128), metadata={
        "description": "A LoRA adapter this key may use (GET /v1/adapters): the job runs under it; unknown: 404"})

    @validates_schema
    def consistent(self, data: dict, **_) -> None:
        if problem := prompt_input_problem(data):
            field, message = problem
            raise ValidationError(message, field)
        if data["kind"] == "score" and "completion_token_ids" not in data:
            raise ValidationError("required when kind is score", "completion_token_ids")
        if data["kind"] == "generate" and "completion_token_ids" in data:
            raise ValidationError("only for kind score", "completion_token_ids")


class SubmitJobSchema(JobRequestSchema):
    stream_events = fields.Boolean(load_default=False, metadata={
        "description": "The caller will read GET /v1/jobs/{id}/events: its tokens are written from the job's "
                       "start (otherwise from when a reader is first seen, within ~50 ms)"})


class SyncGenerateRequestSchema(JobRequestSchema):
    timeout = StrictFloat(allow_nan=False, validate=validate.Range(0, 3600), load_default=60.0,
                           metadata={"description": "Seconds to wait before answering 202 with the job link"})


class ErrorInfoSchema(Schema):
    code = fields.String()
    message = fields.String()
    errors = fields.Raw(metadata={"description": "Details, when the error has them (e.g. field and index)"})


TopLogprobs = fields.List(fields.List(fields.Raw(), validate=validate.Length(equal=2)),
                          metadata={"description": "[[token_id, logprob], ...], most likely first"})


class ChoiceSchema(Schema):
    index = fields.Integer()
    token_ids = NumberList(fields.Integer())
    logprobs = NumberList(fields.Float(), allow_none=True)
    finish_reason = fields.String(metadata={"description": "stop | length | abort | policy_lag"})
    matched_stop = fields.Raw(allow_none=True, metadata={
        "description": "The stop token id (eos included) or stop string that ended the choice"})
    text = fields.String(allow_none=True, metadata={"description": "The choice's text (null: detokenize false)"})
    top_logprobs = fields.List(TopLogprobs, allow_none=True, metadata={"description": "Per token (top_logprobs)"})
    weight_versions = fields.List(fields.Dict(), allow_none=True, metadata={
        "description": "[{version, start, end}]: the weights of token_ids[start:end]"})
    sampling_mask = fields.Dict(allow_none=True, metadata={
        "description": "sampling_params.sampling_mask: {token_ids, offsets}, token i drawn from "
                       "token_ids[offsets[i]:offsets[i + 1]] (vLLM's SamplingMask)"})
    kv_recomputed = fields.Boolean(allow_none=True, metadata={
        "description": "null: crossed no update; else whether the new weights computed its earlier KV again"})
    routed_experts = fields.Dict(allow_none=True, metadata={
        "description": "sampling_params.routed_experts: {dtype, shape: [prompt + output - 1, MoE layers, k], "
                       "data: base64 of the ids in C order} (engine/routing/encoding.py)"})


class ResultSchema(Schema):
    prompt_token_ids = NumberList(fields.Integer())
    placeholder_ranges = fields.List(fields.Dict())
    choices = fields.List(fields.Nested(ChoiceSchema))
    completion_logprobs = NumberList(fields.Float(), metadata={"description": "kind=score"})
    routed_experts = fields.Dict(allow_none=True, metadata={
        "description": "kind=score with sampling_params.routed_experts: every position's (prompt and completion) "
                       "ids, packed as choices[].routed_experts"})
    prompt_logprobs = NumberList(fields.Float(allow_none=True), allow_none=True, metadata={
        "description": "sampling_params.prompt_logprobs: per prompt token (null for the first)"})
    prompt_top_logprobs = fields.List(TopLogprobs, allow_none=True)
    prompt_logprobs_version = fields.String(allow_none=True, metadata={
        "description": "The weights that computed prompt_logprobs"})
    usage = fields.Dict()
    cached_tokens = fields.Integer(metadata={
        "description": "Prompt tokens this job did not compute: its prompt's KV was shared with its prompt group "
                       "or found in the GPU worker's recent-prompt cache"})
    weight_version = fields.String()
    timings = fields.Dict(metadata={"description": "Seconds per stage, and the most rows decoding with this job"})
    transport = fields.String(metadata={"description": "How the features travelled: shm | cuda_ipc | inline"})
    nodes = fields.Dict(metadata={"description": "The nodes that preprocessed and generated the job"})


class JobSchema(Schema):
    id = fields.String()
    object = fields.Constant("job")
    kind = fields.String()
    status = fields.String(metadata={"description": " | ".join(JOB_STATUSES)})
    created_at = fields.Float()
    started_at = fields.Float(allow_none=True)
    completed_at = fields.Float(allow_none=True)
    request_id = fields.String(allow_none=True)
    metadata = fields.Dict(allow_none=True)
    result = fields.Nested(ResultSchema, allow_none=True)
    error = fields.Nested(ErrorInfoSchema, allow_none=True)
    links = fields.Dict()


class ListQuerySchema(Schema):
    """Paging of the caller's own objects, newest first (jobs, batches)."""

    limit = fields.Integer(strict=False, validate=validate.Range(1, 1000), load_default=50)
    cursor = fields.String(validate=validate.Regexp(r"^[0-9]+(\.[0-9]+)?$"))


class JobListQuerySchema(ListQuerySchema):
    status = fields.String(validate=validate.OneOf(JOB_STATUSES))


class JobPollQuerySchema(Schema):
    wait = wait_field("the job")


MAX_LOOKUP_IDS = 1000


class JobLookupSchema(Schema):
    ids = fields.List(fields.String(validate=validate.Length(1, 64)), required=True,
                      validate=validate.Length(1, MAX_LOOKUP_IDS),
                      metadata={"description": f"Up to {MAX_LOOKUP_IDS} job ids"})
    wait = wait_field("every job")


class JobLookupResultSchema(Schema):
    data = fields.List(fields.Nested(JobSchema), metadata={"description": "The caller's jobs among ids, in order"})
    missing = fields.List(fields.String(), metadata={"description": "Ids that are no job of the caller's"})


MAX_BULK_JOBS = 1000


class BulkSubmitSchema(Schema):
    jobs = fields.List(fields.Nested(JobRequestSchema), required=True, validate=validate.Length(1, MAX_BULK_JOBS),
                       metadata={"description": f"Up to {MAX_BULK_JOBS} job requests, each as POST /v1/jobs takes one"})


class RefusedJobSchema(Schema):
    index = fields.Integer(metadata={"description": "The refused request's place in jobs"})
    code = fields.String()
    message = fields.String()


class BulkSubmitResultSchema(Schema):
    data = fields.List(fields.Nested(JobSchema, allow_none=True), metadata={
        "description": "One entry per request, in order: the job, or null where the request was refused"})
    refused = fields.List(fields.Nested(RefusedJobSchema), metadata={
        "description": "The requests the queue caps refused (code queue_full): send them again after Retry-After"})


class ListedJobSchema(JobSchema):
    """A job as ``GET /v1/jobs`` lists it: a result may be tens of MB, ``GET /v1/jobs/{id}`` serves it."""

    class Meta:
        exclude = ("result",)


class JobListSchema(Schema):
    data = fields.List(fields.Nested(ListedJobSchema))
    next_cursor = fields.String(allow_none=True)


class SyncResultSchema(Schema):
    request_id = fields.String(allow_none=True)
    prompt_token_ids = NumberList(fields.Integer())
    choices = fields.List(fields.Nested(ChoiceSchema))
    completion_logprobs = NumberList(fields.Float(allow_none=True), allow_none=True, metadata={
        "description": "kind score: each completion token's teacher-forced logprob"})
    prompt_logprobs = NumberList(fields.Float(allow_none=True), allow_none=True)
    prompt_top_logprobs = fields.List(TopLogprobs, allow_none=True)
    usage = fields.Dict()
    cached_tokens = fields.Integer()
    job_id = fields.String()
    weight_version = fields.String(allow_none=True, metadata={"description": "The weights of its last token"})
    prompt_logprobs_version = fields.String(allow_none=True)
