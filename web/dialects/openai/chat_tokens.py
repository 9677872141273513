"""prime-rl's ``POST /v1/chat/completions/tokens``: a chat completion whose prompt is the body's
``tokens``, as given; its ``messages`` and ``tools`` still choose and drive the reply's parsers.

The shape matched (not copied) from prime-rl's ``ChatCompletionRequestWithTokens`` (vLLM's
``ChatCompletionRequest`` plus ``tokens: list[int]``, src/prime_rl/inference/vllm/
serving_chat_with_tokens.py) and the verifiers client that sends it
(``OpenAIChatCompletionsTokenClient``: the messages, the tools, the stitched ``tokens``, its
sampling args with ``return_token_ids``). The ids are checked as any token prompt's: in the
vocabulary and within the context, a 4xx naming ``tokens`` in OpenAI's error shape. Media are
not taken here (verifiers sends a conversation with media as messages)."""

from __future__ import annotations

from typing import Any

from marshmallow import fields

from domain.sessions import fingerprint
from engine.errors import InvalidRequestError
from web.dialects.openai.chat import ChatPrompt, chat_job_request, chat_messages, checked_template_kwargs
from web.dialects.openai.request import ChatCompletionRequestSchema, check_model
from web.dialects.openai.session_turns import SessionTurn, tokens_turn
from web.dialects.openai.tools import checked_tools


class ChatTokensRequestSchema(ChatCompletionRequestSchema):
    tokens = fields.Raw(required=True, metadata={"description": "The prompt's token ids, used as given"})


def chat_tokens_request(body: dict[str, Any]) -> tuple[dict[str, Any], SessionTurn | None]:
    check_model(body.get("model"))
    tools = checked_tools(body)
    kwargs = checked_template_kwargs(body)
    _, parts = chat_messages(body["messages"])
    if parts:
        raise InvalidRequestError("messages with media are not taken with tokens: send them to /v1/chat/completions",
                                  errors={"messages": ["no media parts with tokens"]})
    request = chat_job_request(ChatPrompt(body, "", []), body["tokens"], ids_field="tokens")
    turn = tokens_turn(body, fingerprint.context_digest(tools, kwargs))
    if turn is not None:
        request["sampling_params"]["logprobs"] = True  # the trajectory's; the reply shows them only if asked
    return request, turn
