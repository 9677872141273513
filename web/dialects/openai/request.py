"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``, with vLLM's extensions.

Bodies and replies follow OpenAI's API reference and vLLM's ``vllm/entrypoints/openai/protocol.py``
(CompletionRequest / CompletionResponse, ChatCompletionRequest / ChatCompletionResponse,
CompletionLogProbs, ChatCompletionLogProbs; the vLLM extras RL code sends: ``top_k``, ``min_p``,
``min_tokens``, ``repetition_penalty``, ``skip_special_tokens``, ``return_token_ids``,
``return_tokens_as_token_ids``, ...). The official ``openai`` Python client is the test client.

``logprobs`` here: completions take an integer k and return, per token, the sampled token's
logprob and a dict of it plus the k most likely tokens; chat takes ``logprobs: true`` and
``top_logprobs: k``. All are of the model's raw distribution (see README).
"""

from __future__ import annotations

from typing import Any

from marshmallow import ValidationError, fields, validate, validates_schema

from engine.choice import Choice
from engine.errors import NotFoundError
from web.api.adapters import choose as choose_adapter
from web.api.schemas import StrictBoolean
from web.api.session_header import validate_session_id
from web.dialects.common import (
    TokenTexts,
    served_model_name,
    vocab_size,
)
from web.dialects.fields import (
    NullMeansDefault,
    OneOrMany,
    StreamOptionsSchema,
    TokenIdsOrBatch,
    refuse_non_default,
)
from web.dialects.sampling import native_sampling, sampling_fields
from web.dialects.structured import openai_structured

MAX_LOGPROBS = 20
# OpenAI / vLLM knobs this service cannot honour: accepted only at these values.
_UNSUPPORTED = {"suffix": (None, ""), "logit_bias": (None, {}), "best_of": (None, 1), "echo_chat": (False,),
                "functions": (None, []), "continue_final_message": (False,), "priority": (0,),
                "allowed_token_ids": (None,), "bad_words": (None, []), "kv_transfer_params": (None,),
                "truncate_prompt_tokens": (None,), "logits_processors": (None,), "mm_processor_kwargs": (None, {}),
                # vLLM's extra field; AReaL always sends it (false).
                "use_beam_search": (None, False)}


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"


def check_model(name: str | None) -> str:
    """The served model's name; ``name`` must be it, or absent (vLLM's rule: AReaL sends none)."""
    served = served_model_name()
    if name is None:
        return served
    if name != served and not choose_adapter(name):  # a LoRA adapter of the caller's: its jobs run under it
        raise ModelNotFoundError(f"The model `{name}` does not exist; this server serves `{served}`.",
                                 errors={"model": [f"must be {served!r}"]})
    return served


# The sampling knobs as schema fields, shared by every body that carries them.
_Knobs = type("_Knobs", (NullMeansDefault,), sampling_fields())


class _Common(_Knobs):
    model = fields.String(metadata={
        "description": "The served model (GET /v1/models); absent: the served one (vLLM's rule; AReaL sends none)"})
    max_tokens = fields.Integer(strict=True)
    stream = StrictBoolean(metadata={"description": "true: Server-Sent Events chunks, then data: [DONE]"})
    stream_options = fields.Nested(StreamOptionsSchema)
    user = fields.String(metadata={"description": "An end-user id; recorded nowhere"})
    return_token_ids = StrictBoolean()
    return_tokens_as_token_ids = StrictBoolean()
    request_id = fields.String(validate=validate.Length(1, 256))
    cache_salt = fields.String(validate=validate.Length(1, 256), metadata={
        "description": "KV blocks are reused only between requests of the same key and the same salt"})
    add_special_tokens = StrictBoolean()
    session_id = fields.String(validate=validate_session_id, metadata={
        "description": "An agent's session (as the X-Session-ID header): its chat turns continue its ids"})
    suffix = fields.Raw()
    logit_bias = fields.Raw()
    best_of = fields.Raw()
    priority = fields.Raw()
    # Structured outputs (web/dialects/structured.py): OpenAI's response_format and vLLM's fields.
    response_format = fields.Raw(metadata={"description": "text, json_object, or json_schema {name, schema, strict}"})
    structured_outputs = fields.Raw(metadata={"description": "vLLM's: one of json, regex, choice, grammar, json_object"})
    guided_json = fields.Raw()
    guided_regex = fields.String()
    guided_choice = fields.List(fields.String())
    guided_grammar = fields.String()
    allowed_token_ids = fields.Raw()
    bad_words = fields.Raw()
    kv_transfer_params = fields.Raw()
    truncate_prompt_tokens = fields.Raw()
    logits_processors = fields.Raw()
    use_beam_search = fields.Raw()

    @validates_schema
    def supported(self, data: dict, **_) -> None:
        refuse_non_default(data, _UNSUPPORTED)


class CompletionRequestSchema(_Common):
    prompt = fields.Raw(required=True, metadata={"description": "Text, token ids, or a list of either"})
    logprobs = fields.Integer(strict=True, validate=validate.Range(0, MAX_LOGPROBS))
    echo = StrictBoolean()

    @validates_schema
    def prompt_shape(self, data: dict, **_) -> None:
        prompts_of(data.get("prompt"))


class ChatCompletionRequestSchema(_Common):
    messages = fields.List(fields.Dict(), required=True, validate=validate.Length(min=1, max=1024))
    max_completion_tokens = fields.Integer(strict=True)
    logprobs = StrictBoolean()
    top_logprobs = fields.Integer(strict=True, validate=validate.Range(0, MAX_LOGPROBS))
    tools = fields.Raw(metadata={"description": "OpenAI's function tools, rendered by the chat template (web/dialects/openai/tools.py)"})
    tool_choice = fields.Raw(metadata={"description": "none or auto; required and named functions are a 422 until calls are constrained"})
    parallel_tool_calls = StrictBoolean()
    functions = fields.Raw()
    add_generation_prompt = StrictBoolean()
    continue_final_message = fields.Raw()
    chat_template_kwargs = fields.Dict(keys=fields.String())
    mm_processor_kwargs = fields.Raw()
    echo = fields.Raw(data_key="echo", attribute="echo_chat")

    @validates_schema
    def one_limit(self, data: dict, **_) -> None:
        if "max_tokens" in data and "max_completion_tokens" in data:
            raise ValidationError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        if data.get("top_logprobs") and not data.get("logprobs"):  # as OpenAI: it would be dropped
            raise ValidationError("top_logprobs needs logprobs: true", "top_logprobs")


def prompts_of(prompt: Any) -> tuple[list, bool]:
    """The prompts (each a string or a list of ids) and whether the body held a list of them."""
    if isinstance(prompt, str):
        return [prompt], False
    try:
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            return [TokenIdsOrBatch().deserialize(prompt)], False
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return TokenIdsOrBatch().deserialize(prompt), True
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return OneOrMany(fields.String()).deserialize(prompt), True
    except ValidationError as exc:  # the item's errors, under the field's name (not a bare index)
        raise ValidationError(exc.messages, "prompt") from None
    raise ValidationError("must be a string, a list of token ids, or a non-empty list of either", "prompt")


FIELD_NAMES = {"sampling_params.max_tokens": "max_tokens", "sampling_params.top_logprobs": "logprobs",
          "request_id": "request_id", "token_ids": "prompt"}


def native_params(body: dict[str, Any]) -> dict[str, Any]:
    params = native_sampling(body, vocab_size())
    if (constraint := openai_structured(body)) is not None:  # response_format, or vLLM's fields
        params["structured_output"] = constraint
    return params


def speller(texts: TokenTexts, as_ids: bool):
    return (lambda token_id: f"token_id:{token_id}") if as_ids else texts


def stop_reason(choice: Choice) -> int | str | None:
    """vLLM's ``stop_reason``: the stop token or string that ended the choice. (``finish_reason``
    is ours as is: stop | length | abort are vLLM's names too.)"""
    return choice.matched_stop if choice.finish_reason == "stop" else None
