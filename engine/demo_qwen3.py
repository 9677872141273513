"""The demo with tools and thinking: a tiny Qwen3-VL model whose tokenizer knows Qwen3's
``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and
``</tool_response>`` as added tokens that are not special (as in Qwen3's own tokenizer: decoding
keeps them, so the reply parsers see them), and whose chat template is written here in Qwen3's
form: the tools as JSON inside ``<tools></tools>`` in the system turn, calls as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, tool results as ``<tool_response>``
in a user turn, an assistant's ``reasoning_content`` in ``<think>``, and ``enable_thinking:
false`` closing an empty think block after the generation prompt."""

from __future__ import annotations

from engine.demo_archs import _QWEN_SPECIALS, ArchSpec, _write_qwen3_vl

QWEN3_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# {{ '\n' }}, never a literal newline right after a block tag: HF renders with trim_blocks.
_CONTENT = (
    "{% macro render_content(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content is not none %}{% for part in content %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
)
_SYSTEM = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ render_content(messages[0]['content']) + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ render_content(messages[0]['content']) }}<|im_end|>\n"
    "{% endif %}"
)
_ASSISTANT = (
    "<|im_start|>assistant\n"
    "{% if message.get('reasoning_content') %}"
    "<think>\n{{ message['reasoning_content'].strip('\\n') }}\n</think>\n\n"
    "{% endif %}"
    "{{ render_content(message['content']) }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set call = call['function'] if 'function' in call else call %}"
    "{% if loop.first and message['content'] %}{{ '\\n' }}{% elif not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call['name'] }}\", \"arguments\": "
    "{% if call['arguments'] is string %}{{ call['arguments'] }}"
    "{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
)
_TOOL = (
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ render_content(message['content']) }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
)
QWEN3_CHAT_TEMPLATE = (
    _CONTENT + _SYSTEM
    + "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' %}" + _ASSISTANT
    + "{% elif message['role'] == 'tool' %}" + _TOOL
    + "{% else %}<|im_start|>{{ message['role'] + '\\n' + render_content(message['content']) }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

QWEN3_TOOLS = ArchSpec(_QWEN_SPECIALS, None, "<|im_end|>", "<|endoftext|>", QWEN3_CHAT_TEMPLATE, _write_qwen3_vl,
                       added_tokens=QWEN3_ADDED)
