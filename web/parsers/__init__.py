"""Parsers of a model's generated text, beside the dialects that serve it (as vLLM keeps its
``--tool-call-parser`` and ``--reasoning-parser`` registries): ``tool/`` turns a family's tool-call
markup into OpenAI ``tool_calls``, ``reasoning/`` splits ``<think>`` text into
``reasoning_content``. Each parser reads the whole text (a reply) or grows with it (a stream),
and a stream's deltas always add up to the whole text's parse (``tests/web/parsers``).
``select.py`` picks them for the served model; ``message.py`` makes an OpenAI message of them."""
