"""Reasoning parsers on fixed texts, as vLLM's qwen3 and deepseek_r1 parsers split them."""

from __future__ import annotations

import pytest

from web.parsers.reasoning import REASONING_PARSERS


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_think_split(name):
    parser = REASONING_PARSERS[name]()
    # The template put <think> in the prompt: only </think> is generated.
    assert parser.parse("plan it\n</think>\n\nAnswer.") == ("plan it\n", "\n\nAnswer.")
    # The model wrote <think> itself: it is dropped.
    assert parser.parse("<think>\nplan</think>Answer") == ("\nplan", "Answer")
    # Cut off while thinking: all of it is reasoning.
    assert parser.parse("<think>still going") == ("still going", "")
    # A stream holds back what may still be a marker.
    assert parser.parse("<thi", final=False) == ("", "")
    assert parser.parse("<think>abc</th", final=False) == ("abc", "")
    assert parser.parse("abc</think>", final=False) == ("abc", "")


def test_qwen3_follows_enable_thinking_and_deepseek_does_not():
    assert REASONING_PARSERS["qwen3"].follows_enable_thinking
    assert not REASONING_PARSERS["deepseek_r1"].follows_enable_thinking
