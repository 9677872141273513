"""OpenAI's API, with vLLM's extensions: ``/v1/completions`` (``completions``) and
``/v1/chat/completions`` (``chat``), their shared schemas and helpers (``request``), streamed
chunks (``stream``), the routes (``views``), and the Batch API's lines and batch object
(``batch_lines``, ``batch_object``). What the other dialects and the batch lines use of it is
named here."""

from web.dialects.openai.chat import (
    ChatPrompt,
    chat_job_request,
    chat_logprob_entries,
    chat_messages,
    chat_prompt,
    chat_prompts_token_ids,
    chat_reply,
    chat_request,
    checked_template_kwargs,
)
from web.dialects.openai.completions import completion_logprobs, completion_reply, completion_requests
from web.dialects.openai.request import (
    ChatCompletionRequestSchema,
    CompletionRequestSchema,
    check_model,
    prompts_of,
    speller,
    stop_reason,
)

__all__ = [
    "ChatCompletionRequestSchema", "ChatPrompt", "CompletionRequestSchema", "chat_job_request",
    "chat_logprob_entries", "chat_messages", "chat_prompt", "chat_prompts_token_ids", "chat_reply",
    "chat_request", "check_model", "checked_template_kwargs", "completion_logprobs", "completion_reply",
    "completion_requests", "prompts_of", "speller", "stop_reason",
]
