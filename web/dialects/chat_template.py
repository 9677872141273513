"""What a request may pass to the served chat template (``chat_template_kwargs``): only the variables
that template reads.

The kwargs reach transformers' ``apply_chat_template(**kwargs)``, which takes a ``chat_template``
kwarg as the template itself (any key's own Jinja run in the API process: loops for minutes, a
100 MB string from a 90-byte body) and ``tokenize``, ``conversation``, ``tools``... as its own
arguments. So kwargs are allowed by name: the undeclared variables of the served template (jinja2's
``meta.find_undeclared_variables``, e.g. Qwen3's ``enable_thinking``), less what the service or
``apply_chat_template`` sets itself. A request's own template is refused unless
``ROLLOUT_TRUST_REQUEST_CHAT_TEMPLATE`` is set, as vLLM's ``--trust-request-chat-template``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequestError

REQUEST_TEMPLATE = "chat_template"
# Set by the service (the conversation, and what its own fields say) or by transformers.
_SET_BY_SERVICE = frozenset({"messages", "conversation", "add_generation_prompt", "tools", "documents",
                             "raise_exception", "strftime_now"})


class ChatTemplateRefusedError(InvalidRequestError):
    """The chat template raised on the conversation: its ``raise_exception`` (many templates refuse
    roles that do not alternate, or a system message where none is taken), or a request's own
    template that does not parse. The client's conversation, not the service, is at fault."""

    code = "chat_template_refused"


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool, kwargs: Mapping[str, Any],
           tools: list[dict] | None = None) -> str:
    """The prompt text of ``messages`` (and ``tools``, OpenAI's function tools) through the
    tokenizer's chat template (``kwargs`` as ``template_kwargs`` checked them)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools, **kwargs)
    except TemplateError as exc:
        raise ChatTemplateRefusedError(f"the chat template refused the conversation: {exc}",
                                       errors={"messages": [str(exc)]}) from None


def template_kwargs(body: Mapping[str, Any], tokenizer, *, trust_request_template: bool) -> dict[str, Any]:
    """``body["chat_template_kwargs"]`` checked against the served template: a 422 naming every key
    it does not read (or the request's own template, unless trusted)."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if not kwargs:
        return {}
    allowed = template_variables(tokenizer)
    bad = {}
    for name in kwargs:
        if name == REQUEST_TEMPLATE:
            if not trust_request_template:
                bad[name] = ["a request's own chat template is refused (ROLLOUT_TRUST_REQUEST_CHAT_TEMPLATE)"]
        elif name not in allowed:
            bad[name] = [f"not a variable of the served chat template; it reads {sorted(allowed) or 'none'}"]
    if bad:
        names = ", ".join(sorted(bad))
        raise InvalidRequestError(f"chat_template_kwargs: {names} not taken (the served chat template reads "
                                  f"{sorted(allowed) or 'no variables'})",
                                  errors={f"chat_template_kwargs.{name}": why for name, why in bad.items()})
    return kwargs


def template_variables(tokenizer) -> frozenset[str]:
    """The variables the tokenizer's chat template(s) read that a request may set."""
    taken = _taken_by_apply_chat_template(type(tokenizer)) | frozenset(tokenizer.special_tokens_map)
    return _undeclared(_sources(tokenizer)) - _SET_BY_SERVICE - taken


def reads_tools(tokenizer) -> bool:
    """Whether the chat template reads ``tools`` (one that does not would drop them unseen)."""
    return "tools" in _undeclared(_sources(tokenizer))


def _sources(tokenizer) -> tuple[str, ...]:
    template = tokenizer.chat_template
    return tuple(sorted(template.values())) if isinstance(template, dict) else (template or "",)


@lru_cache(maxsize=8)
def _undeclared(sources: tuple[str, ...]) -> frozenset[str]:
    env = ImmutableSandboxedEnvironment()
    found: set[str] = set()
    for source in sources:
        found |= meta.find_undeclared_variables(env.parse(source))
    return frozenset(found) - frozenset(env.globals)


@lru_cache(maxsize=8)
def _taken_by_apply_chat_template(cls) -> frozenset[str]:
    """``apply_chat_template``'s own named arguments (tokenize, padding, ...): never template variables."""
    parameters = inspect.signature(cls.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD) - {"self"}
