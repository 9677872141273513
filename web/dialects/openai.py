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

from dataclasses import dataclass
from typing import Any

from marshmallow import ValidationError, fields, validate, validates_schema

from domain.jobs.results import JobResult
from engine.choice import Choice
from engine.errors import InvalidRequestError, NotFoundError
from web.dialects import chat_template
from web.dialects.common import (
    TokenTexts,
    carry_request_fields,
    media_url,
    native_request,
    prompt_logprobs_of,
    served_model_name,
    token_ids_of,
    tokenizer,
    usage,
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
from web.schemas import StrictBoolean
from web.services import services

MAX_LOGPROBS = 20
# OpenAI / vLLM knobs this service cannot honour: accepted only at these values.
_UNSUPPORTED = {"suffix": (None, ""), "logit_bias": (None, {}), "best_of": (None, 1), "echo_chat": (False,),
                "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
                "continue_final_message": (False,), "priority": (0,), "guided_json": (None,),
                "guided_regex": (None,), "guided_choice": (None,), "structured_outputs": (None,),
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
    if name != served:
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
    suffix = fields.Raw()
    logit_bias = fields.Raw()
    best_of = fields.Raw()
    priority = fields.Raw()
    guided_json = fields.Raw()
    guided_regex = fields.Raw()
    guided_choice = fields.Raw()
    structured_outputs = fields.Raw()
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
    tools = fields.Raw()
    tool_choice = fields.Raw()
    parallel_tool_calls = fields.Raw()
    functions = fields.Raw()
    response_format = fields.Raw()
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


_NAMES = {"sampling_params.max_tokens": "max_tokens", "sampling_params.top_logprobs": "logprobs",
          "request_id": "request_id", "token_ids": "prompt"}


def _params(body: dict[str, Any]) -> dict[str, Any]:
    return native_sampling(body, vocab_size())


# --- completions ---------------------------------------------------------------------------------


def completion_requests(body: dict[str, Any]) -> list[dict[str, Any]]:
    if body.get("stream") and body.get("echo"):
        raise InvalidRequestError("echo is not served with stream: true", errors={"echo": ["not with stream"]})
    check_model(body.get("model"))
    prompts, batch = prompts_of(body["prompt"])
    tok = tokenizer()
    requests = []
    for i, prompt in enumerate(prompts):
        ids = prompt if isinstance(prompt, list) else tok(prompt, add_special_tokens=body.get(
            "add_special_tokens", True))["input_ids"]
        params = _params(body)
        k = body.get("logprobs")
        params["logprobs"] = k is not None
        if k:
            params["top_logprobs"] = k
        if body.get("echo") and k is not None:
            params.setdefault("prompt_logprobs", k)
        native = carry_request_fields(body, {"token_ids": ids, "sampling_params": params})
        names = {f"sampling_params.{n}": n for n in params} | _NAMES
        if batch:
            names["token_ids"] = f"prompt[{i}]"
        requests.append(native_request(native, names, vocab_size=vocab_size(), tokenized=ids is not prompt))
    return requests


def completion_reply(body: dict[str, Any], requests: list[dict], jobs: list[dict], created: int) -> dict:
    texts = TokenTexts()
    spell = _speller(texts, body.get("return_tokens_as_token_ids", False))
    prompts, _ = prompts_of(body["prompt"])
    choices, results = [], []
    for i, (request, job) in enumerate(zip(requests, jobs, strict=True)):
        n = request["sampling_params"]["n"]
        result = JobResult.of(job, n=n)
        results.append(result)
        prompt_ids = result.prompt_token_ids or request["token_ids"]
        echo_text = ""
        if body.get("echo"):
            echo_text = prompts[i] if isinstance(prompts[i], str) else tokenizer().decode(prompt_ids)
        for choice in result.choices:
            entry = {"index": i * n + choice.index, "text": echo_text + (choice.text or ""),
                     "logprobs": completion_logprobs(choice, result, prompt_ids, body, spell)
                     if body.get("logprobs") is not None else None,
                     "finish_reason": choice.finish_reason, "stop_reason": stop_reason(choice)}
            if body.get("return_token_ids"):
                entry.update(prompt_token_ids=prompt_ids, token_ids=choice.token_ids)
            if body.get("prompt_logprobs") is not None:  # vLLM's extra, per choice in its completion reply
                entry["prompt_logprobs"] = prompt_logprobs_of(result, texts)
            choices.append(entry)
    return {"id": "cmpl-" + jobs[0]["id"].removeprefix("job_"), "object": "text_completion", "created": created,
            "model": served_model_name(), "choices": choices, "usage": usage(*results),
            "system_fingerprint": JobResult.of(jobs[0]).weight_version}


def completion_logprobs(choice: Choice, result: JobResult | None, prompt_ids: list[int], body: dict, spell) -> dict:
    """vLLM's ``CompletionLogProbs`` of a choice (with ``echo``, the prompt's first)."""
    ids, lps = list(choice.token_ids), list(choice.logprobs or [])
    tops = list(choice.top_logprobs or [[] for _ in ids])
    if body.get("echo") and result is not None:
        prompt_lps = result.prompt_logprobs or [None] * len(prompt_ids)
        prompt_tops = result.prompt_top_logprobs or [[] for _ in prompt_ids]
        ids, lps, tops = list(prompt_ids) + ids, list(prompt_lps) + lps, [t or [] for t in prompt_tops] + tops
    tokens = [spell(t) for t in ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top_dicts = []
    for token_id, lp, step in zip(ids, lps, tops, strict=True):
        # vLLM's dict: the sampled token and the k most likely ones.
        entry = {} if lp is None else {spell(token_id): lp}
        for alt, alt_lp in step:
            entry.setdefault(spell(alt), alt_lp)
        top_dicts.append(entry or None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_dicts, "text_offset": offsets}


# --- chat ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatPrompt:
    """A chat body checked and its conversation rendered by the chat template: all of its job
    request but the token ids (a batch file tokenizes many of these in one call)."""

    body: dict[str, Any]
    text: str
    parts: list[dict]

    @property
    def add_special_tokens(self) -> bool:
        return self.body.get("add_special_tokens", False)


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    prompt = chat_prompt(body)
    ids = tokenizer()(prompt.text, add_special_tokens=prompt.add_special_tokens)["input_ids"]
    return chat_job_request(prompt, ids)


def chat_prompt(body: dict[str, Any]) -> ChatPrompt:
    check_model(body.get("model"))
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError("tool_choice: tools are not served", errors={"tool_choice": ["not supported"]})
    template_messages, parts = chat_messages(body["messages"])
    text = chat_template.render(tokenizer(), template_messages,
                                add_generation_prompt=body.get("add_generation_prompt", True),
                                kwargs=checked_template_kwargs(body))
    return ChatPrompt(body, text, parts)


def chat_prompts_token_ids(prompts: list[ChatPrompt], tok=None) -> list[list[int]]:
    """Each prompt's token ids as ``chat_request`` tokenizes one, in one tokenizer call per
    ``add_special_tokens`` value (with ``tok``, ``tokenizer()``, from any thread)."""
    ids: list[list[int]] = [[] for _ in prompts]
    groups: dict[bool, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt.add_special_tokens, []).append(i)
    for special, at in groups.items():
        encoded = token_ids_of([prompts[i].text for i in at], add_special_tokens=special, tok=tok)
        for i, token_ids in zip(at, encoded, strict=True):
            ids[i] = token_ids
    return ids


def chat_job_request(prompt: ChatPrompt, ids: list[int]) -> dict[str, Any]:
    """The native job request of a rendered chat prompt and its token ids. The template wrote every
    special token the model wants; media placeholders stay collapsed (one per item) and are
    expanded by the preprocessing worker, exactly once."""
    body = prompt.body
    params = _params({**body, **({"max_tokens": body["max_completion_tokens"]}
                                 if "max_completion_tokens" in body else {})})
    params["logprobs"] = bool(body.get("logprobs"))
    if body.get("logprobs") and body.get("top_logprobs"):
        params["top_logprobs"] = body["top_logprobs"]
    native: dict[str, Any] = {"token_ids": ids, "sampling_params": params}
    if prompt.parts:
        native["content_parts"] = prompt.parts
    carry_request_fields(body, native)
    names = {f"sampling_params.{n}": n for n in params} | {"sampling_params.top_logprobs": "top_logprobs",
                                                            "content_parts": "messages", "token_ids": "messages"}
    return native_request(native, names, vocab_size=vocab_size(), tokenized=True)


def checked_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The body's ``chat_template_kwargs`` the served template reads (web/dialects/chat_template.py)."""
    return chat_template.template_kwargs(body, tokenizer(), trust_request_template=services().settings.trust_request_chat_template)


def chat_messages(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """OpenAI messages as HF chat templates read them (media as ``{"type": "image"}`` etc.) and
    their media as our content parts, in order. ``image_url`` / ``video_url`` take a URL, a data
    URL or raw base64; ``input_audio`` is ``{data: base64, format}``."""
    out, parts = [], []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise _bad(f"messages[{i}].role", "must be a string")
        for name in ("audio", "refusal"):  # an assistant's audio reply or refusal: not served, never dropped
            if message.get(name) is not None:
                raise _bad(f"messages[{i}].{name}", "not supported here")
        converted: dict[str, Any] = {k: v for k, v in message.items() if k in ("role", "name", "tool_calls",
                                                                                 "tool_call_id")}
        if content is None or isinstance(content, str):
            converted["content"] = content or ""
        elif isinstance(content, list):
            converted["content"] = [_part(part, f"messages[{i}].content[{j}]", parts)
                                    for j, part in enumerate(content)]
        else:
            raise _bad(f"messages[{i}].content", "must be a string or a list of parts")
        out.append(converted)
    return out, parts


def _part(part: Any, where: str, parts: list[dict]) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    for name, template_type, part_type in (("image_url", "image", "image_url"), ("video_url", "video", "video_url")):
        if kind == name:
            ref = part.get(name)
            url = ref.get("url") if isinstance(ref, dict) else ref
            parts.append({"type": part_type, "url": media_url(url, f"{where}.{name}.url"),
                          **({"uuid": str(part["uuid"])} if part.get("uuid") is not None else {})})
            return {"type": template_type}
    if kind == "input_audio" and isinstance(part.get("input_audio"), dict):
        audio = part["input_audio"]
        data, fmt = audio.get("data"), audio.get("format") or "wav"
        if not isinstance(data, str) or not isinstance(fmt, str) or not fmt.isalnum():
            raise _bad(f"{where}.input_audio", "needs base64 data and a format")
        parts.append({"type": "audio_url", "url": f"data:audio/{fmt};base64,{data}"})
        return {"type": "audio"}
    raise _bad(where, "must be a text, image_url, video_url or input_audio part")


def _bad(where: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {what}", errors={where: [what]})


def chat_reply(body: dict[str, Any], request: dict, job: dict, created: int) -> dict:
    result = JobResult.of(job, n=request["sampling_params"]["n"])
    spell = _speller(TokenTexts(), body.get("return_tokens_as_token_ids", False))
    choices = []
    for choice in result.choices:
        entry = {"index": choice.index,
                 "message": {"role": "assistant", "content": choice.text or "", "tool_calls": [],
                             "reasoning_content": None},
                 "logprobs": {"content": chat_logprob_entries(choice, spell, body.get("top_logprobs") or 0)}
                 if body.get("logprobs") else None,
                 "finish_reason": choice.finish_reason, "stop_reason": stop_reason(choice)}
        if body.get("return_token_ids"):
            entry["token_ids"] = choice.token_ids
        choices.append(entry)
    reply = {"id": "chatcmpl-" + job["id"].removeprefix("job_"), "object": "chat.completion", "created": created,
             "model": served_model_name(), "choices": choices,
             "usage": usage(result),
             "system_fingerprint": result.weight_version}
    if body.get("return_token_ids"):
        reply["prompt_token_ids"] = result.prompt_token_ids or request["token_ids"]
    if body.get("prompt_logprobs") is not None:  # vLLM's extra, top level in its chat reply
        reply["prompt_logprobs"] = prompt_logprobs_of(result, TokenTexts())
    return reply


def chat_logprob_entries(choice: Choice, spell, k: int) -> list[dict]:
    """OpenAI's ``logprobs.content``: per token its spelling, logprob, bytes and the top k."""
    tops = choice.top_logprobs or [[] for _ in choice.token_ids]
    out = []
    for token_id, lp, step in zip(choice.token_ids, choice.logprobs or [], tops, strict=True):
        token = spell(token_id)
        out.append({"token": token, "logprob": max(lp, -9999.0), "bytes": list(token.encode()),
                    "top_logprobs": [{"token": spell(alt), "logprob": max(alt_lp, -9999.0),
                                      "bytes": list(spell(alt).encode())} for alt, alt_lp in step[:k]]})
    return out


def _speller(texts: TokenTexts, as_ids: bool):
    return (lambda token_id: f"token_id:{token_id}") if as_ids else texts


def stop_reason(choice: Choice) -> int | str | None:
    """vLLM's ``stop_reason``: the stop token or string that ended the choice. (``finish_reason``
    is ours as is: stop | length | abort are vLLM's names too.)"""
    return choice.matched_stop if choice.finish_reason == "stop" else None
