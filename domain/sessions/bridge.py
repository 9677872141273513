"""The tokens between a turn's sampled ids and the next turn's generation prompt, from the chat
template alone, so a next turn's prompt is the last turn's prompt and sampled ids exactly plus
these: only the new messages are tokenized.

The way verifiers' token client stitches a turn (``OpenAIChatCompletionsTokenClient.get_prompt_ids``
in PrimeIntellect-ai/verifiers, matched here, not copied): render a stand-in assistant message
followed by the new messages, and the stand-in alone without a generation prompt; the second must
be a prefix of the first; what follows the stand-in's end of turn is the bridge. A stand-in (empty
reasoning, content ``x``, or calls named after the tool messages that answer them) keeps
templates that render an assistant by its place (Qwen3's think block) from rendering it two ways.

The last turn's end: when its last sampled id is the end-of-turn id the template writes after the
stand-in, the bridge starts after it (``end_of_turn`` "sampled"); a turn cut short (``length``, a
stop string) has the template's end of turn given as the bridge's first token ("given")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# messages, add_generation_prompt -> the template's token ids for them (the served tools and
# chat_template_kwargs bound in).
Render = Callable[[list[dict[str, Any]], bool], list[int]]


class BridgeError(ValueError):
    """Why a turn cannot continue the last one's ids: the turn is rendered from its messages instead
    and its reply names the reason (never an error a client gets)."""

    def __init__(self, reason: str):  # a short code: no_new_messages, assistant_not_sampled, ...
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Bridge:
    token_ids: list[int]
    end_of_turn: str  # "sampled" | "given"


def stand_in(new_messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message rendered in place of the last turn's: calls for the tool messages that
    open the new messages (templates check a tool message answers a call), else content ``x``."""
    ids = []
    for message in new_messages:
        if message.get("role") != "tool":
            break
        ids.append(message.get("tool_call_id") or f"call_{len(ids)}")
    if ids:
        return {"role": "assistant", "reasoning_content": "", "content": "",
                "tool_calls": [{"id": i, "type": "function", "function": {"name": "f", "arguments": {}}} for i in ids]}
    return {"role": "assistant", "reasoning_content": "", "content": "x"}


def bridge(render: Render, new_messages: list[dict[str, Any]], *, add_generation_prompt: bool,
           stop_token: int | None, end_of_turn_ids: frozenset[int]) -> Bridge:
    """The bridge after a turn whose sampled ids ended with ``stop_token`` (None: cut short).
    ``end_of_turn_ids``: the ids that may end an assistant turn in the template (the eos ids)."""
    if not new_messages:
        raise BridgeError("no_new_messages")
    if any(m.get("role") == "assistant" for m in new_messages):
        raise BridgeError("assistant_not_sampled")
    assistant = stand_in(new_messages)
    base = render([assistant], False)
    full = render([assistant, *new_messages], add_generation_prompt)
    if full[:len(base)] != base:
        raise BridgeError("template_not_prefix")
    ends = {stop_token} if stop_token is not None else set()
    at = _last_index(base, ends)
    if at is not None:
        return Bridge(full[at + 1:], "sampled")
    at = _last_index(base, set(end_of_turn_ids))
    if at is None:
        raise BridgeError("no_end_of_turn")
    return Bridge(full[at:], "given")


def _last_index(ids: list[int], wanted: set[int]) -> int | None:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] in wanted:
            return i
    return None
