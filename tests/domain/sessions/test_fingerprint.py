"""Whether a turn's messages extend the session's last turn (domain/sessions/fingerprint.py): what
a client may change without changing the prompt (content None or "", text parts, call ids, the
arguments' spacing, the returned reasoning dropped) still extends; anything else does not."""

from __future__ import annotations

from domain.sessions.fingerprint import context_digest, message_digests, new_messages, returned_digests

HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
RETURNED = {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
            "tool_calls": [{"id": "call_abc", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
TOOL = {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"}


def extends(messages):
    return new_messages(message_digests(HISTORY), returned_digests(RETURNED), messages)


def test_the_returned_message_as_a_client_sends_it_back_extends():
    assert extends([*HISTORY, RETURNED, TOOL]) == [TOOL]
    without_reasoning = {k: v for k, v in RETURNED.items() if k != "reasoning_content"}
    respaced = {**without_reasoning, "content": "", "tool_calls": [
        {"id": "call_other", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}
    assert extends([*HISTORY, respaced, TOOL]) == [TOOL]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, HISTORY[1]]
    assert extends([*parts, RETURNED, TOOL]) == [TOOL]


def test_changed_history_or_reply_or_nothing_new_does_not_extend():
    assert extends([*HISTORY, RETURNED]) is None  # nothing new
    assert extends([HISTORY[0], {"role": "user", "content": "Weather in Rome?"}, RETURNED, TOOL]) is None
    other_args = {**RETURNED, "tool_calls": [{"id": "call_abc", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}
    assert extends([*HISTORY, other_args, TOOL]) is None
    other_reasoning = {**RETURNED, "reasoning_content": "Something else."}
    assert extends([*HISTORY, other_reasoning, TOOL]) is None
    assert extends([HISTORY[1], RETURNED, TOOL]) is None


def test_the_context_names_tools_and_template_variables():
    assert context_digest(None, {}) == context_digest([], {})
    assert context_digest(None, {}) != context_digest([{"type": "function"}], {})
    assert context_digest(None, {}) != context_digest(None, {"enable_thinking": False})
