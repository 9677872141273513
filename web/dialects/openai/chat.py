"""OpenAI's ``/v1/chat/completions``: a chat body rendered by the chat template into a job request,
its messages' media, and the job's result as its reply (message, logprobs in the chat shape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from domain.jobs.results import JobResult
from engine.choice import Choice
from engine.errors import InvalidRequestError
from engine.grammar.errors import InvalidGrammarError
from engine.routing.encoding import nested
from web.dialects import chat_template
from web.dialects.common import (
    TokenTexts,
    carry_request_fields,
    media_url,
    native_request,
    prompt_logprobs_of,
    reply_model_name,
    token_ids_of,
    tokenizer,
    usage,
    vocab_size,
)
from web.dialects.openai.request import check_model, native_params, speller, stop_reason
from web.dialects.openai.tools import (
    check_tool_answers,
    checked_tools,
    forced_tool_calls,
    reply_parsers,
    template_tool_calls,
)
from web.dialects.sampling import RENAMED
from web.parsers.message import finish_reason, parsed_message
from web.services import services


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
    tools = checked_tools(body)
    template_messages, parts = chat_messages(body["messages"])
    text = chat_template.render(tokenizer(), template_messages,
                                add_generation_prompt=body.get("add_generation_prompt", True),
                                kwargs=checked_template_kwargs(body), tools=tools)
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


def chat_job_request(prompt: ChatPrompt, ids: list[int], *, ids_field: str = "messages") -> dict[str, Any]:
    """The native job request of a rendered chat prompt and its token ids. The template wrote every
    special token the model wants; media placeholders stay collapsed (one per item) and are
    expanded by the preprocessing worker, exactly once. ``ids_field``: the body's field the ids
    came from, which errors name (``tokens``: the client's own, checked id by id)."""
    body = prompt.body
    params = native_params({**body, **({"max_tokens": body["max_completion_tokens"]}
                                 if "max_completion_tokens" in body else {})})
    params["logprobs"] = bool(body.get("logprobs"))
    if (calls := forced_tool_calls(body)) is not None:  # tool_choice required or named
        if "structured_output" in params:
            raise InvalidGrammarError("tool_choice required or named writes calls: give no other constraint",
                                      errors={"tool_choice": ["give no response_format or structured_outputs"]})
        params["structured_output"] = calls
    if body.get("logprobs") and body.get("top_logprobs"):
        params["top_logprobs"] = body["top_logprobs"]
    native: dict[str, Any] = {"token_ids": ids, "sampling_params": params}
    if prompt.parts:
        native["content_parts"] = prompt.parts
    carry_request_fields(body, native)
    names = {f"sampling_params.{n}": RENAMED.get(n, n) for n in params} | {"sampling_params.top_logprobs": "top_logprobs",
                                                            "content_parts": "messages", "token_ids": ids_field}
    return native_request(native, names, vocab_size=vocab_size(), tokenized=ids_field == "messages")


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
        converted: dict[str, Any] = {k: v for k, v in message.items() if k in ("role", "name", "tool_call_id",
                                                                                 "reasoning_content")}
        if message.get("tool_calls") is not None:
            converted["tool_calls"] = template_tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
        if content is None or isinstance(content, str):
            converted["content"] = content or ""
        elif isinstance(content, list):
            converted["content"] = [_part(part, f"messages[{i}].content[{j}]", parts)
                                    for j, part in enumerate(content)]
        else:
            raise _bad(f"messages[{i}].content", "must be a string or a list of parts")
        out.append(converted)
    check_tool_answers(out)
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
    spell = speller(TokenTexts(), body.get("return_tokens_as_token_ids", False))
    parsers = reply_parsers(body)
    choices = []
    for choice in result.choices:
        message = parsed_message(choice.text or "", parsers)
        entry = {"index": choice.index,
                 "message": message,
                 "logprobs": {"content": chat_logprob_entries(choice, spell, body.get("top_logprobs") or 0)}
                 if body.get("logprobs") else None,
                 "finish_reason": finish_reason(choice.finish_reason, bool(message["tool_calls"])),
                 "stop_reason": stop_reason(choice)}
        if body.get("return_token_ids"):
            entry["token_ids"] = choice.token_ids
        if request["sampling_params"].get("sampling_mask"):  # return_sampling_mask: vLLM's CSR
            entry["sampling_mask"] = choice.sampling_mask
        if request["sampling_params"].get("routed_experts"):  # return_routed_experts: vLLM's lists
            entry["routed_experts"] = nested(choice.routed_experts)
        choices.append(entry)
    reply = {"id": "chatcmpl-" + job["id"].removeprefix("job_"), "object": "chat.completion", "created": created,
             "model": reply_model_name(), "choices": choices,
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


