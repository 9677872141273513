"""The bridge between a turn's sampled ids and the next turn's generation prompt
(domain/sessions/bridge.py), on the real demo tokenizers and chat templates: stitched to the last
turn's ids it gives exactly the template's own prompt of the whole conversation whenever the
sampled ids are the template's own ids of the reply (so nothing is lost or added), for a reply
that ended on its end-of-turn id, one cut short (the end of turn given), and tool results; a
template that renders the turn before the new messages two ways is refused, not stitched."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from domain.sessions.bridge import BridgeError, bridge

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from engine.demo_model import build_demo_model

    return AutoTokenizer.from_pretrained(build_demo_model(tmp_path_factory.mktemp("models") / "q3", arch="qwen3_tools"))


@pytest.fixture(scope="module")
def qwen2(demo_model_dir):
    return AutoTokenizer.from_pretrained(demo_model_dir)


def renderer(tok, tools=None, **kwargs):
    def render(messages, add_generation_prompt):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       tools=tools, **kwargs)
        return tok(text, add_special_tokens=False)["input_ids"]
    return render


def stitched(tok, render, history, reply_text, new, *, ended=True):
    """The last turn's prompt, its 'sampled' ids (the template's own ids of the reply text, and its
    end of turn when ``ended``) and the bridge; and the bridge's end of turn."""
    prompt = render(history, True)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = tok(reply_text, add_special_tokens=False)["input_ids"] + ([eot] if ended else [])
    found = bridge(render, new, add_generation_prompt=True, stop_token=eot if ended else None,
                   end_of_turn_ids=frozenset({tok.eos_token_id}))
    return prompt + sampled + found.token_ids, found.end_of_turn


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
@pytest.mark.parametrize("ended", [True, False])
def test_stitched_prompt_is_the_templates_own_prompt_of_the_whole_conversation(request, name, ended):
    tok = request.getfixturevalue(name)
    render = renderer(tok)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    new = [{"role": "user", "content": "And then?"}]
    ids, end = stitched(tok, render, history, "Hello! How can I help?", new, ended=ended)
    whole = render([*history, {"role": "assistant", "content": "Hello! How can I help?"}, *new], True)
    assert ids == whole
    assert end == ("sampled" if ended else "given")


def test_tool_results_after_calls_bridge_with_the_tools_rendered(qwen3):
    render = renderer(qwen3, tools=[WEATHER])
    history = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    calls = [{"id": f"call_{c}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
             for c in ("Paris", "Rome")]
    reply = "\n".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
                      for c in ("Paris", "Rome"))
    new = [{"role": "tool", "tool_call_id": "call_Paris", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call_Rome", "content": "rain"}]
    ids, end = stitched(qwen3, render, history, reply, new)
    whole = render([*history, {"role": "assistant", "content": "", "tool_calls": calls}, *new], True)
    assert ids == whole and end == "sampled"
    assert qwen3.decode(ids).endswith("<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_template_kwargs_reach_the_bridge(qwen3):
    render = renderer(qwen3, enable_thinking=False)
    history = [{"role": "user", "content": "Hi"}]
    new = [{"role": "user", "content": "Again"}]
    ids, _ = stitched(qwen3, render, history, "<think>\n\n</think>\n\nHello", new)
    assert qwen3.decode(ids).endswith("<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_template_that_renders_the_last_assistant_apart_is_refused(qwen2):
    tok = AutoTokenizer.from_pretrained(qwen2.name_or_path)
    # As Qwen3's own template does with reasoning: the last message is rendered unlike earlier ones.
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{% if loop.last and m['role'] == 'assistant' %}<think>\n\n</think>\n\n{% endif %}"
                         "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(BridgeError) as refused:
        bridge(renderer(tok), [{"role": "user", "content": "next"}], add_generation_prompt=True,
               stop_token=tok.convert_tokens_to_ids("<|im_end|>"), end_of_turn_ids=frozenset({tok.eos_token_id}))
    assert refused.value.reason == "template_not_prefix"


def test_an_assistant_message_among_the_new_ones_is_refused(qwen2):
    with pytest.raises(BridgeError) as refused:
        bridge(renderer(qwen2), [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
               add_generation_prompt=True, stop_token=None, end_of_turn_ids=frozenset({qwen2.eos_token_id}))
    assert refused.value.reason == "assistant_not_sampled"
